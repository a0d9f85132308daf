"""How good is a drafter, and does decoding see the drafter that training saw?

For each response, the teacher-forced top-1 accuracy of the drafter's base logits at block
positions 1..P (the block rooted at every response token, context = the target's states before
it, exactly as in training), next to ``chain`` decoding's accepted tokens per round on the same
prompt. Chain accepts position 1 exactly when the teacher-forced top-1 is right at the round's
root, so the two columns must agree up to which roots the rounds land on; a gap would mean
decoding feeds the drafter something training did not.

    python bench/analysis/drafter_accuracy.py                                  # shipped drafter, SmolLM2
    python bench/analysis/drafter_accuracy.py --drafter runs/x/drafter --num 4 --positions 4
    python bench/analysis/drafter_accuracy.py --drafter a=runs/a/drafter,b=runs/b/drafter --num 10 --no-chain

Several ``label=DIR`` drafters are scored on the same responses (the target's greedy answers,
decoded once) with a mean row per drafter and source kind: a paired comparison of drafters
that needs no tree decoding. ``--no-chain`` skips the chain column (plain AR decodes the
evaluation responses instead).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.loading import encode_prompt, load_drafter, load_target, stop_tokens

HERE = os.path.dirname(os.path.abspath(__file__))


@torch.no_grad()
def target_hidden_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return getattr(target, target.base_model_prefix)(input_ids=ids, output_hidden_states=True).hidden_states


@torch.no_grad()
def teacher_forced_accuracy(drafter, ids: torch.Tensor, hidden_states, start: int, positions: int) -> list[float]:
    """Top-1 accuracy at block positions 1..``positions`` over the anchors ``start..len-2`` of the
    sequence ``ids [1, L]``, given the target's ``hidden_states`` over it (computed once per
    sequence and shared by every drafter)."""
    context = drafter.project_context(drafter.target_features(hidden_states))
    length = ids.shape[1]
    slots = torch.arange(length, device=ids.device)[None]
    anchors = torch.arange(start, length - 1, device=ids.device)
    if anchors.numel() == 0:
        return [float("nan")] * positions
    draft = drafter(ids[0, anchors], anchors, context.expand(len(anchors), -1, -1), slots.expand(len(anchors), -1),
                    slots < anchors[:, None])
    pred = draft.target_ids(draft.base_logits.argmax(-1))  # [A, D - 1]: position k predicts seq[anchor + k]
    acc = []
    for k in range(1, positions + 1):
        pos = anchors + k
        ok = pos < length
        hits = pred[ok, k - 1] == ids[0, pos[ok]]
        acc.append(hits.float().mean().item() if ok.any() else float("nan"))
    return acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=os.path.join(HERE, "..", "..", "dartree_ext", "drafters", "smollm2-135m-vat"),
                   help="a drafter directory, or label=DIR,label=DIR to compare several on the same responses")
    p.add_argument("--data", default=os.path.join(HERE, "..", "data", "smollm2_responses.jsonl"),
                   help="training responses (JSON lines with 'prompt' and 'response' token ids)")
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--num", type=int, default=2, help="responses per training file / evaluation set")
    p.add_argument("--positions", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--no-chain", action="store_true", help="decode the evaluation responses with AR, no chain column")
    args = p.parse_args(argv)
    loaded = load_target(args.target)
    target, tok = loaded.target, loaded.tokenizer
    import sys
    sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
    from e2e import parse_drafters  # bench/e2e/e2e.py
    drafters = [(label or "drafter", load_drafter(path, target).float()) for label, path in parse_drafters(args.drafter)]
    stops = stop_tokens(tok, target)
    cols = " ".join(f"{'pos' + str(k):>6s}" for k in range(1, args.positions + 1))
    print(f"{'source':24s} {'drafter':>10s} {'anchors':>7s} {cols} {'chain accepted/round':>20s}")
    hits: dict[tuple[str, str], list[list[float]]] = {}  # (kind, label) -> per position [hits, anchors]

    def report(kind: str, source: str, seq: list[int], start: int, chain: str) -> None:
        n = len(seq) - start - 1
        ids = torch.tensor(seq, device=next(target.parameters()).device)[None]
        states = target_hidden_states(target, ids)
        for j, (label, drafter) in enumerate(drafters):  # the target runs once per response, not per drafter
            acc = teacher_forced_accuracy(drafter, ids, states, start, args.positions)
            print(f"{source:24s} {label:>10s} {n:7d} {' '.join(f'{a:6.3f}' for a in acc)} "
                  f"{chain if j == 0 else '':>20s}")
            rows = hits.setdefault((kind, label), [[0.0, 0] for _ in range(args.positions)])
            for k, a in enumerate(acc):
                if a == a:  # position k + 1 exists for n - k anchors
                    rows[k][0] += a * (n - k)
                    rows[k][1] += n - k

    if args.data and os.path.exists(args.data):
        with open(args.data) as f:
            records = [json.loads(line) for _, line in zip(range(args.num), f)]
        for r in records:
            report("train", "train " + str(r.get("id", "")), r["prompt"] + r["response"], len(r["prompt"]), "-")
    from dartree_ext.data import prompts as shipped
    method = "ar" if args.no_chain else "chain"
    for name in [s for s in args.sets.split(",") if s]:
        for i, item in enumerate(getattr(shipped, name)()[:args.num]):
            ids = encode_prompt(tok, item.text)
            out = SpeculativeDecoder(target, drafters[0][1], method).generate(
                torch.tensor([ids]), max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            rs = out.stats.requests[0]
            resp = out.sequences[0, len(ids):len(ids) + rs.new_tokens].tolist()
            chain = "-" if args.no_chain else f"{sum(rs.accepted) / rs.rounds:.3f}"
            report("eval", f"{name} {i}", ids + resp, len(ids), chain)
    print("mean over responses (every anchor counts once):")
    for (kind, label), rows in hits.items():
        means = " ".join(f"{h / max(1, c):6.3f}" for h, c in rows)
        print(f"{kind + ' mean':24s} {label:>10s} {rows[0][1]:7d} {means} {'-':>20s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
