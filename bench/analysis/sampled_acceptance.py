"""At T > 0, how often would the target accept the drafter's first position under two ways of
verifying it? On the target's own samples at temperature T (decoded by the library's `ar` loop),
at every response position (the anchor), with p = the target's next-token distribution and q =
the drafter's block position 1 (over its draft vocabulary, zero elsewhere), both at T:

- fixed drafts, as this library verifies at T > 0 (sample the target's token at a node, accept
  the child that equals it): the top-k of q as children accept with probability p(top-k), for
  k = 1, 2, 4, 8;
- speculative sampling (one draft x ~ q, accepted with probability min(1, p(x) / q(x)), else a
  token from the residual): 1 - TV(p, q) = sum_x min(p(x), q(x)).

    python bench/analysis/sampled_acceptance.py                         # shipped drafter, 6 prompts a set, T = 1
    python bench/analysis/sampled_acceptance.py --sets mtbench --num 10 --temperature 0.7

Lossless either way; the figures say how much a sampled draft would gain over fixed ones.
"""
from __future__ import annotations

import argparse
import os

import torch

from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.loading import encode_prompt, load_drafter, load_target, stop_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = (1, 2, 4, 8)


@torch.no_grad()
def acceptance(target, drafter, seq: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """Per anchor ``start .. len - 2`` of ``seq [1, L]``: p(top-k of q) for k in TOP, then
    1 - TV(p, q): ``[anchors, len(TOP) + 1]``."""
    out = target(input_ids=seq, output_hidden_states=True)
    length = seq.shape[1]
    context = drafter.project_context(drafter.target_features(out.hidden_states))
    slots = torch.arange(length, device=seq.device)[None]
    anchors = torch.arange(start, length - 1, device=seq.device)
    draft = drafter(seq[0, anchors], anchors, context.expand(len(anchors), -1, -1), slots.expand(len(anchors), -1),
                    slots < anchors[:, None])
    p = torch.softmax(out.logits[0, anchors].float() / temperature, -1)
    q_draft = torch.softmax(draft.base_logits[:, 0].float() / temperature, -1)
    q = torch.zeros_like(p)
    if draft.vocab is None:
        q = q_draft
    else:
        q[:, draft.vocab.to(q.device)] = q_draft
    top = q.topk(max(TOP), -1).indices
    fixed = p.gather(1, top).cumsum(1)[:, [k - 1 for k in TOP]]
    return torch.cat([fixed, torch.minimum(p, q).sum(-1, keepdim=True)], 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default=os.path.join(HERE, "..", "..", "dartree_ext", "drafters", "smollm2-135m-vat"))
    ap.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    ap.add_argument("--num", type=int, default=6, help="prompts a set")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (at T = 0 both ways accept the same draft)")
    loaded = load_target(args.target)
    target, tok = loaded.target, loaded.tokenizer
    drafter = load_drafter(args.drafter, target).float()
    stops = stop_tokens(tok, target)
    plain = SpeculativeDecoder(target, None, "ar")
    from dartree_ext.data import prompts as shipped
    print(f"T = {args.temperature}; position-1 acceptance, mean over anchors")
    print(f"{'set':10s} {'anchors':>7s} " + " ".join(f"{'top' + str(k):>6s}" for k in TOP) + f" {'1-TV':>6s}")
    for name in [s for s in args.sets.split(",") if s]:
        rows = []
        for i, item in enumerate(getattr(shipped, name)()[:args.num]):
            ids = encode_prompt(tok, item.text)
            gen = torch.Generator().manual_seed(i)
            out = plain.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 stop_token_ids=stops, generator=gen)
            n = out.stats.requests[0].new_tokens
            rows.append(acceptance(target, drafter, out.sequences[:, :len(ids) + n], len(ids) - 1, args.temperature))
        m = torch.cat(rows).mean(0).tolist()
        print(f"{name:10s} {sum(len(r) for r in rows):7d} " + " ".join(f"{v:6.3f}" for v in m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
