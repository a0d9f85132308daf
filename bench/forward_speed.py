"""Target forward cost on this machine: few_rows_linear against torch's linear, first over the
weights alone and then in the target's forward over n new tokens, per dtype (and per thread count
with --threads); --prefill adds a 256-token forward's throughput.

    python bench/forward_speed.py --target smollm2 --json bench/results/forward_speed.json
    python bench/forward_speed.py --threads 1,2 --rows "" --tokens 1,65 --prefill

Part 1 runs 60 distinct [1536, 576] weights (SmolLM2's MLP shape, 53M parameters, more than the
caches hold) through each implementation, best of 5, every implementation in turn at each row
count. Part 2 times the target's forward over n new tokens after a 200-token cache
(:func:`dartree_ext.decoding.cost.forward_ms`; median of --reps, the two linears in turn). Ratios
are torch / few_rows: above 1, few_rows is faster.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dartree_ext import build_info, ops
from dartree_ext.decoding.cost import cpu_bf16_native, device_name, forward_ms
from dartree_ext.linear import LINEAR_KINDS, set_linear
from dartree_ext.loading import load_target

DTYPES = (torch.float32, torch.bfloat16)


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
def forward_times(model: torch.nn.Module, tokens: list[int], reps: int) -> list[dict]:
    dtype = next(model.parameters()).dtype
    samples = {(kind, n): [] for kind in LINEAR_KINDS for n in tokens}
    for _ in range(reps):
        for n in tokens:
            for kind in LINEAR_KINDS:
                set_linear(model, kind)
                samples[(kind, n)].append(forward_ms(model, n, 1, context=200))
    set_linear(model, "torch")
    out = []
    for n in tokens:
        t, f = (statistics.median(samples[(k, n)]) for k in ("torch", "few_rows"))
        out.append({"tokens": n, "torch_ms": round(t, 2), "few_rows_ms": round(f, 2), "ratio": round(t / f, 3)})
        print(f"  {str(dtype)[6:]:9s} {n:3d} tokens: torch {t:6.1f} ms  few_rows {f:6.1f} ms  torch / few_rows "
              f"{t / f:.2f}", flush=True)
    return out


@torch.no_grad()
def prefill_tokens_per_s(model: torch.nn.Module, tokens: int = 256) -> float:
    """Tokens per second of one forward over ``tokens`` fresh tokens (second of two calls)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(ids)
    start = time.perf_counter()
    model(ids)
    return tokens / (time.perf_counter() - start)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="'smollm2', 'smollm2-arch' (random weights) or a directory")
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64", help="part 1's row counts ('' skips it)")
    p.add_argument("--tokens", default="1,4,8,16,24,32", help="part 2's new-token counts ('' skips it)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", default="2", help="thread counts, e.g. 1,2 (each runs every part)")
    p.add_argument("--prefill", action="store_true", help="also a 256-token forward's tokens/s (torch's linear)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows, tokens, threads = _ints(args.rows), _ints(args.tokens), _ints(args.threads)
    result = {"device": device_name("cpu"), "bf16_native": cpu_bf16_native(), "torch": torch.__version__,
              "few_rows_linear": build_info()["few_rows_linear"], "runs": []}
    print(f"{result['device']} (bf16 native: {result['bf16_native']}), few_rows paths {result['few_rows_linear']}")
    models = {dtype: load_target(args.target, dtype=dtype).target for dtype in DTYPES} if tokens or args.prefill else {}
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        run = {"threads": n_threads, "op": {}, "forward": {}, "prefill_tok_s": {}}
        print(f"{n_threads} threads")
        if rows:
            print("60 x [1536, 576] weights:")
            for dtype in DTYPES:
                run["op"][str(dtype)[6:]] = op_times(dtype, rows)
        if tokens:
            print(f"{args.target} forward after a 200-token cache:")
            for dtype, model in models.items():
                run["forward"][str(dtype)[6:]] = forward_times(model, tokens, args.reps)
        if args.prefill:
            for dtype, model in models.items():
                run["prefill_tok_s"][str(dtype)[6:]] = round(prefill_tokens_per_s(model), 1)
            print(f"  256-token forward, tokens/s: {run['prefill_tok_s']}")
        result["runs"].append(run)
    if len(result["runs"]) == 1:  # one thread count: the flat layout of earlier records
        result.update(threads=threads[0], **{k: v for k, v in result.pop("runs")[0].items() if k != "threads"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
