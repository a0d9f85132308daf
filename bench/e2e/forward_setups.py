"""The target's forward over n new tokens for each (dtype, linear) set-up, flat and through the
modules: what a plain step (n = 1) and a tree verification (n = root + nodes) cost.

    python bench/e2e/forward_setups.py --rows 1,8,16,24,32 --reps 5 --json bench/results/xeon/forward_setups.json

Each forward runs as the decoding loops call the target (``forward_ms``: a 4D additive mask,
positions, a cache of --context tokens), median of --reps after a warm-up; every (set-up, forward
kind) in turn at each row count, the whole sweep --rounds times, the median over rounds reported.
``flat / modules`` is the modules' time over the flat forward's (above 1: the flat forward is
faster); ``x 1 row`` is a row count's time over the same set-up's one-row time (what a verification
costs in plain steps).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from dartree_ext.decoding.profiling import device_name, forward_ms
from dartree_ext.flat_forward import restore_module_forward, use_flat_forward
from dartree_ext.linear import linear_kinds, set_linear
from dartree_ext.loading import load_target

SETUPS = ("float32+gguf", "bfloat16+gguf", "bfloat16+few_rows", "bfloat16+amx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--setups", default=",".join(SETUPS), help="dtype+linear, comma-separated")
    parser.add_argument("--rows", default="1,8,16,24,32")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]
    base = load_target(args.target, dtype=torch.float32).target
    models = {}
    for setup in args.setups.split(","):
        dtype_name, kind = setup.split("+")
        if kind not in linear_kinds(base):
            print(f"skipping {setup}: linear {kind!r} is not available here")
            continue
        model = base if dtype_name == "float32" else copy.deepcopy(base).to(getattr(torch, dtype_name))
        if any(m is model for m in models.values()):
            model = copy.deepcopy(base)
        set_linear(model, kind)
        models[setup] = model
    samples: dict = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for n in rows:
                for setup, model in models.items():
                    for flat in (True, False):
                        (use_flat_forward if flat else restore_module_forward)(model)
                        ms = forward_ms(model, n, args.reps, context=args.context)
                        samples.setdefault((setup, flat, n), []).append(ms)
    med = {key: statistics.median(v) for key, v in samples.items()}
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"context {args.context}, median of {args.rounds} rounds x {args.reps} reps")
    print("| set-up | rows | flat ms | modules ms | flat / modules | flat x 1 row |")
    print("|---|---|---|---|---|---|")
    table = []
    for setup in models:
        for n in rows:
            flat, mod = med[(setup, True, n)], med[(setup, False, n)]
            one = med[(setup, True, rows[0])]
            table.append({"setup": setup, "rows": n, "flat_ms": round(flat, 2), "modules_ms": round(mod, 2),
                          "modules_over_flat": round(mod / flat, 3), "over_first_row_count": round(flat / one, 2)})
            print(f"| {setup} | {n} | {flat:.2f} | {mod:.2f} | {mod / flat:.3f} | {flat / one:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name("cpu"), "threads": torch.get_num_threads(), "context": args.context,
                       "rounds": args.rounds, "reps": args.reps, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
