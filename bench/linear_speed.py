"""few_rows_linear against torch's linear on this CPU: the op over the rows of a verification
forward, and the whole target's forward over n new tokens with either, per dtype.

    python bench/linear_speed.py --target smollm2 --json bench/results/linear_speed.json

Part 1 runs 60 distinct [1536, 576] weights (SmolLM2's MLP shape, 53M parameters, more than the
caches hold) through each implementation, best of 5, every implementation in turn at each row
count. Part 2 times the target's forward over n new tokens after a 200-token cache (median of
--reps, the two linears in turn). Ratios are torch / few_rows: above 1, few_rows is faster.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dartree_ext import build_info, ops
from dartree_ext.decoding.cost import _forward_ms, cpu_bf16_native, device_name
from dartree_ext.linear import set_linear
from dartree_ext.loading import load_target


def op_times(dtype: torch.dtype, rows: list[int], reps: int = 5) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=gen).to(dtype) for _ in range(60)]
    impls = {"torch": lambda x, w: torch.nn.functional.linear(x, w), "few_rows": lambda x, w: ops.few_rows_linear(x, w)}
    out = []
    for m in rows:
        x = torch.randn(m, 576, generator=gen).to(dtype)
        best = {name: float("inf") for name in impls}
        for _ in range(reps):
            for name, f in impls.items():
                start = time.perf_counter()
                for w in weights:
                    f(x, w)
                best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
        out.append({"rows": m, **{f"{k}_ms": round(v, 2) for k, v in best.items()},
                    "ratio": round(best["torch"] / best["few_rows"], 3)})
        print(f"  {str(dtype)[6:]:9s} rows {m:3d}: torch {best['torch']:6.1f} ms  few_rows {best['few_rows']:6.1f} ms"
              f"  torch / few_rows {best['torch'] / best['few_rows']:.2f}", flush=True)
    return out


@torch.no_grad()
def forward_times(target: str, dtype: torch.dtype, tokens: list[int], reps: int) -> list[dict]:
    model = load_target(target, dtype=dtype).target
    samples = {(kind, n): [] for kind in ("torch", "few_rows") for n in tokens}
    for _ in range(reps):
        for n in tokens:
            for kind in ("torch", "few_rows"):
                set_linear(model, kind)
                samples[(kind, n)].append(_forward_ms(model, n, 1, context=200))
    out = []
    for n in tokens:
        t, f = (statistics.median(samples[(k, n)]) for k in ("torch", "few_rows"))
        out.append({"tokens": n, "torch_ms": round(t, 2), "few_rows_ms": round(f, 2), "ratio": round(t / f, 3)})
        print(f"  {str(dtype)[6:]:9s} {n:3d} tokens: torch {t:6.1f} ms  few_rows {f:6.1f} ms  torch / few_rows "
              f"{t / f:.2f}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="'smollm2', 'smollm2-arch' (random weights) or a directory")
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64")
    p.add_argument("--tokens", default="1,4,8,16,24,32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"device": device_name("cpu"), "bf16_native": cpu_bf16_native(), "threads": args.threads,
              "torch": torch.__version__, "few_rows_linear": build_info()["few_rows_linear"], "op": {}, "forward": {}}
    print(f"{result['device']} (bf16 native: {result['bf16_native']}), {args.threads} threads, "
          f"few_rows paths {result['few_rows_linear']}")
    rows = [int(v) for v in args.rows.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    print("60 x [1536, 576] weights:")
    for dtype in (torch.float32, torch.bfloat16):
        result["op"][str(dtype)[6:]] = op_times(dtype, rows)
    print(f"{args.target} forward after a 200-token cache:")
    for dtype in (torch.float32, torch.bfloat16):
        result["forward"][str(dtype)[6:]] = forward_times(args.target, dtype, tokens, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
