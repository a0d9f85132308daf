"""Where a decoding round's time goes, function by function: the decoder's phases (drafter pass,
tree, verification, commit) and the calls inside them, in ms per round, for `ar` and a method on
the same prompt, the target set up as `dartree-generate` sets it up (`--dtype`, `--linear`).

    python bench/round_phases.py                                  # the main command's haiku
    python bench/round_phases.py --mtbench 1 --temperature 1      # MT-Bench question 1, sampled

Each listed function is wrapped with a timer (a few microseconds per call, included in the
figures); nested calls are counted in their callers too, so the rows do not add up. The target's
forward includes the prefill (its calls outnumber the rounds by the prefills). Figures are the
sum over --repeats decodes of the prompt, after one untimed decode per method.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

import dartree_ext.decoding.decoder as decoder_module
import dartree_ext.tree as tree_module
from dartree_ext.cli import _load_for_generate, build_generate_parser
from dartree_ext.decoding import SpeculativeDecoder, left_pad
from dartree_ext.loading import encode_prompt, stop_tokens

DECODER_METHODS = ("_draft", "_tree", "_verify", "_commit", "_retire", "_predict_round", "_observe_round",
                   "build_tree", "choose_tree", "expected_accepted", "_flush_context", "_calibrate",
                   "_calibrate_unverified", "_graft_lookup")


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--mtbench", type=int, default=None, metavar="I",
                        help="decode MT-Bench question I instead of --prompt")
    args = parser.parse_args()
    target, tok, drafter, dtype, _, budget = _load_for_generate(args)
    text = args.prompt
    if args.mtbench is not None:
        from dartree_ext.data.prompts import mtbench
        text = mtbench()[args.mtbench].text
    ids, mask = left_pad([encode_prompt(tok, text, chat=not args.no_chat)])
    stops = stop_tokens(tok, target)

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str | None = None) -> None:
        fn, label = getattr(owner, name), label or name

        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[label] += time.perf_counter() - start
                calls[label] += 1

        setattr(owner, name, wrapper)

    for name in DECODER_METHODS:
        timed(SpeculativeDecoder, name)
    for name in ("choose_size", "prune", "compact_cache_", "target_tokens_from_logits"):
        timed(decoder_module, name)
    for name in ("verify_tree", "tree_attention_mask"):
        timed(decoder_module.ops, name)
    timed(tree_module.ops, "build_supertree")
    for name in ("supertree_as_tree", "candidates"):
        timed(tree_module, name)
    timed(target, "forward", "target.forward")
    if drafter is not None:
        timed(drafter, "forward", "drafter.forward")
        for name in ("project_context", "context_kv"):
            if hasattr(drafter, name):
                timed(drafter, name, f"drafter.{name}")

    def decode(method: str):
        dec = SpeculativeDecoder(target, drafter, method, budget=budget if method != "ar" else 64,
                                 width=args.width, K=args.K, depth_bonus=args.depth_bonus,
                                 estimator=args.estimator, lookup=args.lookup if method != "ar" else None)
        gen = torch.Generator().manual_seed(args.seed)
        return dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops, generator=gen)

    methods = ["ar", args.method]
    for method in methods:  # the cost model, and each shape's first call, out of the figures
        decode(method)
    print(f"dtype {str(dtype).replace('torch.', '')}, linear {args.linear}, T = {args.temperature}, "
          f"{args.repeats} decodes each")
    for method in methods:
        totals.clear()
        calls.clear()
        outs = [decode(method) for _ in range(args.repeats)]
        rounds = sum(o.stats.rounds for o in outs)
        tokens = sum(o.stats.new_tokens for o in outs)
        seconds = sum(o.stats.total_time for o in outs)
        print(f"{method}: {rounds} rounds, {tokens} tokens (tau {tokens / rounds:.3f}), "
              f"{1e3 * seconds / rounds:.2f} ms a round, {1e3 * seconds / tokens:.2f} ms a token")
        for label, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"   {label:28s} {1e3 * secs / rounds:8.3f} ms/round   calls {calls[label]}")


if __name__ == "__main__":
    main()
