"""End-to-end decoding benchmark: every method on the same prompts, side by side in one run.

Prints, per method: tau (tokens per round, micro and macro average), time per token, speedup
over ``ar`` (ratio of total decoding times for the same tokens, measured in this run), the round
time split, mean verified tree size, peak memory where CUDA reports it, and whether the output
equals ``ar``'s (T = 0: it must).

    python bench/e2e.py                          # tiny built-in target, random drafter
    python bench/e2e.py --drafter lookup         # a drafter that knows the AR output (machinery at high tau)
    python bench/e2e.py --target DIR --drafter DIR --prompts prompts.txt
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dartree_ext.decoding import METHODS, SpeculativeDecoder  # noqa: E402
from dartree_ext.loading import encode_prompt, load_drafter, load_target, stop_tokens  # noqa: E402
from dartree_ext.models import LookupDrafter  # noqa: E402

DEFAULT_PROMPTS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a binary heap.",
]


def batch_of(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--drafter", default="random", help="a drafter directory, 'random' or 'lookup'")
    parser.add_argument("--lookup-miss", type=float, default=0.3, help="lookup drafter: chance a position's right "
                                                                      "token is only second best")
    parser.add_argument("--prompts", default=None, help="a file with one prompt per line")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--width", type=int, default=12)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--depth-bonus", type=float, default=-0.2)
    parser.add_argument("--batch", action="store_true", help="decode all prompts as one batch (default: one by one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    loaded = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    target, tok = loaded.target, loaded.tokenizer
    texts = DEFAULT_PROMPTS
    if args.prompts:
        with open(args.prompts) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    texts = texts[:args.num_prompts] if args.num_prompts else texts
    prompts = [encode_prompt(tok, t) for t in texts]
    groups = [prompts] if args.batch else [[p] for p in prompts]
    stops = stop_tokens(tok, target)
    methods = [m for m in args.methods.split(",") if m]
    if "ar" not in methods:
        methods = ["ar"] + methods
    base = None if args.drafter in ("random", "lookup") else args.drafter
    drafter = load_drafter(base, target)

    def run(method, drafter_for_method):
        dec = SpeculativeDecoder(target, drafter_for_method, method, budget=args.budget, width=args.width, K=args.K,
                                 depth_bonus=args.depth_bonus)
        outs, seconds, tokens, rounds, accepted, nodes = [], 0.0, 0, 0, 0, []
        split = {}
        taus = []
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for group in groups:
            ids, mask = batch_of(group)
            gen = torch.Generator(device=args.device).manual_seed(0)
            out = dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               stop_token_ids=stops, generator=gen)
            st = out.stats
            seconds += st.total_time
            tokens += st.new_tokens
            rounds += st.rounds
            accepted += sum(sum(r.accepted) for r in st.requests)
            taus += [r.tau for r in st.requests if r.rounds]
            nodes += st.tree_nodes
            for k, v in st.time.items():
                split[k] = split.get(k, 0.0) + v
            outs.append([out.sequences[b, ids.shape[1]:ids.shape[1] + r.new_tokens].tolist()
                         for b, r in enumerate(st.requests)])
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if args.device == "cuda" else None
        return dict(method=method, tau=accepted / rounds + 1 if rounds else 0.0,
                    tau_macro=sum(taus) / len(taus) if taus else 0.0, seconds=seconds, tokens=tokens,
                    ms_per_token=1e3 * seconds / max(1, tokens), mean_tree_nodes=sum(nodes) / max(1, len(nodes)),
                    split={k: v / seconds for k, v in split.items()} if seconds else {}, peak_mib=peak,
                    outputs=outs)

    # warm-up (first calls pay one-time costs)
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=args.budget, width=args.width, K=args.K)
    dec.generate(batch_of(groups[0])[0], batch_of(groups[0])[1], max_new_tokens=4)

    results = [run("ar", None)]
    ar = results[0]
    if args.drafter == "lookup":
        refs = [torch.tensor(p + o) for g, outs in zip(groups, ar["outputs"]) for p, o in zip(g, outs)]
        drafter = LookupDrafter(drafter, refs, miss=args.lookup_miss)
    for method in methods:
        if method != "ar":
            results.append(run(method, drafter))
    print(f"target={loaded.name} drafter={args.drafter} device={args.device} dtype={args.dtype} "
          f"prompts={len(prompts)} batch={'all' if args.batch else 1} max_new_tokens={args.max_new_tokens} "
          f"T={args.temperature} B={args.budget} W={args.width} K={args.K} beta={args.depth_bonus} "
          f"threads={torch.get_num_threads()}")
    print(f"{'method':16s} {'tau':>6s} {'tau_mac':>7s} {'ms/tok':>8s} {'speedup':>7s} {'nodes':>6s} "
          f"{'draft':>6s} {'tree':>6s} {'verify':>6s} {'book':>6s} {'peakMiB':>8s} same_as_ar")
    for r in results:
        same = r["outputs"] == ar["outputs"] if args.temperature == 0 else None
        r["speedup"] = (ar["seconds"] / ar["tokens"]) / (r["seconds"] / r["tokens"])
        r["same_as_ar"] = same
        s = r["split"]
        peak = f"{r['peak_mib']:8.1f}" if r["peak_mib"] is not None else f"{'-':>8s}"
        print(f"{r['method']:16s} {r['tau']:6.3f} {r['tau_macro']:7.3f} {r['ms_per_token']:8.3f} {r['speedup']:7.3f} "
              f"{r['mean_tree_nodes']:6.1f} {s.get('draft', 0):6.1%} {s.get('tree', 0):6.1%} {s.get('verify', 0):6.1%} "
              f"{s.get('bookkeeping', 0):6.1%} {peak} {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in results], f, indent=2)
    bad = [r["method"] for r in results if r["same_as_ar"] is False]
    if bad:
        print(f"ERROR: outputs differ from ar for {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
