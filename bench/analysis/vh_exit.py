"""EAGLE-3 drafters, teacher-forced: accuracy per step, and the verification head's predicted first
rejection against the true one (the VAT paper's Figure 3).

On the target's greedy answers to the evaluation prompts (Table 1 sets), every anchor ``r`` of a
response with ``K`` tokens after it is a chain round: the drafter unrolled ``K`` steps from ``r``
by the training-time test (exactly what decoding drafts while every token so far is accepted).
The chain accepts ``a`` tokens (leading top-1 hits); the true first rejection is step ``a + 1``.
With threshold ``p``, ``eagle3_vh`` stops before the first step whose head probability is below
``p`` and keeps ``a_p`` tokens. Per drafter and ``p``:

* the mean absolute error ``|a_p - a|`` in tokens (Figure 3),
* the accepted tokens the exit cuts off, ``mean max(a - a_p, 0)`` (tau lost on a chain),
* the drafter steps run, ``mean min(a_p + 1, K)`` (``K`` without an exit; the oracle exit at the
  true first rejection runs ``min(a + 1, K)`` and loses nothing).

Per drafter also the top-``W`` hits per step (``--width``, default 4: the target's token among the
drafter's ``W`` best) and the teacher-forced tree tau, ``1 +`` the leading top-``W`` hits: what a tree
of ``W`` children a node accepts along the true path when its budget does not cut it.

    python bench/analysis/vh_exit.py --drafter vat=runs/e3s/vat/drafter,eagle3=runs/e3s/eagle3/drafter --num 10 \\
        --json bench/results/vh_exit_smollm2.json --plot docs/figures/vh_exit.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.loading import encode_prompt, load_drafter, load_target, stop_tokens
from dartree_ext.models import Eagle3Drafter
from dartree_ext.training.eagle import block_hidden

HERE = os.path.dirname(os.path.abspath(__file__))
THRESHOLDS = [round(0.05 * i, 2) for i in range(1, 20)]


@torch.no_grad()
def chain_rounds(drafter: Eagle3Drafter, ids: torch.Tensor, hidden_states, start: int, width: int = 4):
    """Per anchor ``r = start .. L - 1 - K`` of ``ids [1, L]``: top-1 hits ``bool[n, K]``, head
    probabilities ``float[n, K]`` and top-``width`` hits ``bool[n, K]`` of the drafter unrolled ``K``
    steps from ``r``."""
    k = drafter.config.num_steps
    length = ids.shape[1]
    anchors = torch.arange(start, length - k, device=ids.device)
    if anchors.numel() == 0:
        return None
    outs = drafter(drafter.target_features(hidden_states), ids)
    normed, logits = drafter.head(block_hidden(outs, anchors[None]))
    pred = drafter.vocab_ids(logits.argmax(-1))                                    # [n, K]
    labels = ids[0, anchors[:, None] + torch.arange(1, k + 1, device=ids.device)]   # step k predicts x[r + k]
    prob = torch.sigmoid(drafter.verification_head(normed).float())
    top = drafter.vocab_ids(logits.topk(width, -1).indices)                        # [n, K, W]
    return pred == labels, prob, (top == labels[..., None]).any(-1)


def summarize(hits: torch.Tensor, prob: torch.Tensor, wide: torch.Tensor) -> dict:
    """The figures of the module docstring from every anchor's hits, head probabilities and top-W hits."""
    k = hits.shape[1]
    accepted = hits.long().cumprod(1).sum(1).float()                               # a
    row = {"anchors": int(hits.shape[0]), "top1": hits.float().mean(0).tolist(),
           "chain_tau": 1 + accepted.mean().item(), "oracle_steps": (accepted + 1).clamp(max=k).mean().item(),
           "topw": wide.float().mean(0).tolist(), "tree_tau": 1 + wide.long().cumprod(1).sum(1).float().mean().item(),
           "thresholds": {}}
    for p in THRESHOLDS:
        below = prob < p
        kept = torch.where(below.any(1), below.float().argmax(1), torch.full_like(accepted, k).long()).float()
        row["thresholds"][str(p)] = {
            "mae": (kept - accepted).abs().mean().item(),
            "lost": (accepted - kept).clamp(min=0).mean().item(),
            "steps": (kept + 1).clamp(max=k).mean().item(),
        }
    return row


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for label, row in results.items():
        ps = [float(p) for p in row["thresholds"]]
        ax.plot(ps, [v["mae"] for v in row["thresholds"].values()], marker="o", markersize=3, label=label)
        bx.plot([v["steps"] for v in row["thresholds"].values()], [v["lost"] for v in row["thresholds"].values()],
                marker="o", markersize=3, label=f"{label} (p = 0.05 .. 0.95)")
        bx.scatter([row["oracle_steps"]], [0.0], marker="*", s=80, label=f"{label} oracle")
    ax.set_xlabel("threshold p")
    ax.set_ylabel("|predicted - true first rejection| (tokens)")
    ax.set_title("Verification head: first-rejection error")
    bx.set_xlabel("drafter steps run per round")
    bx.set_ylabel("accepted tokens cut off per round")
    bx.set_title("Early exit: steps saved vs tokens lost (chain)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="an EAGLE-3 drafter directory, or label=DIR,label=DIR")
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench", help="as bench/e2e/e2e.py --sets")
    p.add_argument("--num", type=int, default=10, help="responses per evaluation set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--width", type=int, default=4, help="W of the top-W hits and the teacher-forced tree tau")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of both panels (needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="draw --plot from a --json this script wrote, without scoring anything")
    args = p.parse_args(argv)
    if args.plot:
        import matplotlib  # noqa: F401  (fail before the scoring, not after it)
    if args.from_json:
        if not args.plot:
            p.error("--from-json draws --plot: give both")
        with open(args.from_json) as f:
            results = json.load(f)["results"]
        plot({label: rows["all"] for label, rows in results.items()}, args.plot)
        return 0
    if not args.drafter:
        p.error("--drafter is required (or --from-json with --plot)")
    loaded = load_target(args.target)
    target, tok = loaded.target, loaded.tokenizer
    sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
    from e2e import parse_drafters, prompt_sets  # bench/e2e/e2e.py
    drafters = [(label or "drafter", load_drafter(path, target).float()) for label, path in parse_drafters(args.drafter)]
    for label, d in drafters:
        if not isinstance(d, Eagle3Drafter):
            raise SystemExit(f"{label}: not an EAGLE-3 drafter (bench/analysis/drafter_accuracy.py scores block drafters)")
    stops = stop_tokens(tok, target)
    base = getattr(target, target.base_model_prefix)
    sets = prompt_sets(args.sets, args.num)
    per: dict[tuple[str, str], list] = {}
    for name, texts in sets.items():
        for i, text in enumerate(texts):
            ids = encode_prompt(tok, text)
            out = SpeculativeDecoder(target, None, "ar").generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                                                 stop_token_ids=stops)
            n = out.stats.requests[0].new_tokens
            seq = out.sequences[:, :len(ids) + n]
            with torch.no_grad():
                states = base(input_ids=seq, output_hidden_states=True).hidden_states
            for label, d in drafters:
                got = chain_rounds(d, seq, states, len(ids), args.width)
                if got is not None:
                    per.setdefault((label, name), []).append(got)
            print(f"{name} {i}: {n} tokens", flush=True)
    results: dict = {}
    for label, _ in drafters:
        rows = {}
        for name in sets:
            got = per.get((label, name), [])
            if got:
                rows[name] = summarize(*(torch.cat(parts) for parts in zip(*got)))
        every = [g for (lab, _), gs in per.items() if lab == label for g in gs]
        if not every:
            raise SystemExit(f"no response is longer than {drafters[0][1].config.num_steps} tokens: nothing to score")
        rows["all"] = summarize(*(torch.cat(parts) for parts in zip(*every)))
        results[label] = rows
        print(f"\n{label}: anchors / top-1 at steps 1-3 / teacher-forced chain tau / oracle steps per round / "
              f"top-{args.width} at steps 1-3 / teacher-forced tree tau")
        for name, row in rows.items():
            print(f"  {name:10s} {row['anchors']:5d}  " + " ".join(f"{a:.3f}" for a in row["top1"][:3])
                  + f"  {row['chain_tau']:.3f}  {row['oracle_steps']:.2f}  "
                  + " ".join(f"{a:.3f}" for a in row["topw"][:3]) + f"  {row['tree_tau']:.3f}")
        print("  p      MAE   lost  steps (all sets)")
        for thr, v in rows["all"]["thresholds"].items():
            print(f"  {float(thr):.2f}  {v['mae']:.3f}  {v['lost']:.3f}  {v['steps']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "num": args.num, "max_new_tokens": args.max_new_tokens,
                       "width": args.width,
                       "drafters": dict(parse_drafters(args.drafter)), "results": results}, f, indent=1)
    if args.plot:
        plot({label: rows["all"] for label, rows in results.items()}, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
