"""Target forward cost on this machine: few_rows_linear against torch's linear, first over the
weights alone and then in the target's forward over n new tokens, per dtype (and per thread count
with --threads); --prefill adds a 256-token forward's throughput; --attention times a tree
verification's forward (a tree-attention mask over the cache) through transformers' SDPA attention
against :func:`dartree_ext.attention.gqa_attention` (no repeated keys/values); --drafter-positions
times the shipped drafter's pass for its first p positions only (``BlockDrafter.forward(...,
positions=p)``, what ``budget="auto"`` asks for) against all of them.

    python bench/analysis/forward_speed.py --target smollm2 --json bench/results/forward_speed.json
    python bench/analysis/forward_speed.py --threads 1,2 --rows "" --tokens 1,65 --prefill
    python bench/analysis/forward_speed.py --rows "" --tokens "" --attention 1,4,8,16 --contexts 200,800
    python bench/analysis/forward_speed.py --rows "" --tokens "" --drafter-positions 2,4,6,8
    python bench/analysis/forward_speed.py --rows "" --tokens "" --layers 1,2,4,6,8,12,16

Part 1 runs 60 distinct [1536, 576] weights (SmolLM2's MLP shape, 53M parameters, more than the
caches hold) through each implementation, best of 5, every implementation in turn at each row
count. Part 2 times the target's forward over n new tokens after a 200-token cache
(:func:`dartree_ext.decoding.profiling.forward_ms`; median of --reps, the two linears in turn). Ratios
are torch / few_rows: above 1, few_rows is faster. --layers runs the target's own linear weights
(bfloat16, every layer in the model's order: one forward's weight traffic, the 211 layers of
SmolLM2-135M with its output head) through ``few_rows_linear`` and its forced FMA / VDPBF16PS
paths at each row count, in turn 15 times: each one's median and fastest ms, and FMA / VDPBF16PS
as the median of back-to-back pairs.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch

from dartree_ext import build_info, ops
from dartree_ext.attention import restore_sdpa_attention, use_packed_attention
from dartree_ext.decoding.profiling import _drop_last, cpu_bf16_native, device_name, forward_ms
from dartree_ext.linear import linear_kinds, set_linear
from dartree_ext.loading import load_target

DTYPES = (torch.float32, torch.bfloat16)


def op_times(dtype: torch.dtype, rows: list[int], reps: int = 5) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=gen).to(dtype) for _ in range(60)]
    impls = {"torch": lambda x, w: torch.nn.functional.linear(x, w), "few_rows": lambda x, w: ops.few_rows_linear(x, w)}
    impls.update(_forced_paths(dtype))
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
        forced = "".join(f"  {k} {v:6.1f} ms" for k, v in best.items() if k not in ("torch", "few_rows"))
        if "avx512_fma" in best and "avx512_bf16" in best:
            out[-1]["fma_over_dot"] = round(best["avx512_fma"] / best["avx512_bf16"], 3)
            forced += f"  fma / dot {best['avx512_fma'] / best['avx512_bf16']:.2f}"
        print(f"  {str(dtype)[6:]:9s} rows {m:3d}: torch {best['torch']:6.1f} ms  few_rows {best['few_rows']:6.1f} ms"
              f"  torch / few_rows {best['torch'] / best['few_rows']:.2f}{forced}", flush=True)
    return out


def _forced_paths(dtype: torch.dtype) -> dict:
    """bfloat16 on a CPU with AVX-512: the op's FMA path and (with AVX-512 BF16) its VDPBF16PS
    path, forced, beside the default (which picks between them by rows: docs/ops.md)."""
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    if dtype != torch.bfloat16 or not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return {}
    paths = {"avx512_fma": torch.ops.dartree_ext.few_rows_linear_avx512}
    if "avx512_bf16" in flags:
        paths["avx512_bf16"] = torch.ops.dartree_ext.few_rows_linear_avx512_bf16
    return {name: (lambda x, w, f=f: f(x, w, None)) for name, f in paths.items()}


@torch.no_grad()
def forward_times(model: torch.nn.Module, tokens: list[int], reps: int) -> list[dict]:
    dtype = next(model.parameters()).dtype
    kinds = linear_kinds(model)  # gguf too for a model loaded from a GGUF
    samples = {(kind, n): [] for kind in kinds for n in tokens}
    for _ in range(reps):
        for n in tokens:
            for kind in kinds:
                set_linear(model, kind)
                samples[(kind, n)].append(forward_ms(model, n, 1, context=200))
    set_linear(model, "torch")
    out = []
    for n in tokens:
        t, f = (statistics.median(samples[(k, n)]) for k in ("torch", "few_rows"))
        out.append({"tokens": n, "torch_ms": round(t, 2), "few_rows_ms": round(f, 2), "ratio": round(t / f, 3)})
        line = f"  {str(dtype)[6:]:9s} {n:3d} tokens: torch {t:6.1f} ms  few_rows {f:6.1f} ms  torch / few_rows {t / f:.2f}"
        if "gguf" in kinds:
            g = statistics.median(samples[("gguf", n)])
            out[-1].update(gguf_ms=round(g, 2), few_rows_over_gguf=round(f / g, 3))
            line += f"  gguf {g:6.1f} ms  few_rows / gguf {f / g:.2f}"
        print(line, flush=True)
    return out


@torch.no_grad()
def tree_forward_ms(model: torch.nn.Module, tokens: int, context: int) -> float:
    """One verification forward: root + ``tokens - 1`` nodes (a binary tree) under the tree-attention
    mask, after ``context`` cached tokens (ms; the nodes are dropped from the cache after)."""
    from transformers import DynamicCache
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    key = (id(model), context)
    if _CACHES.get("key") != key:
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, vocab, (1, context), generator=gen), use_cache=True, logits_to_keep=1,
              **{cache_kw: cache})
        _CACHES.update(key=key, cache=cache)
    cache = _CACHES["cache"]
    parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, tokens)]], dtype=torch.int32)
    num_nodes = torch.tensor([tokens], dtype=torch.int32)
    depths = ops.tree_ancestor_bits(parents, num_nodes)[1]
    mask = ops.tree_attention_mask(parents, num_nodes, torch.ones(1, context, dtype=torch.bool), param.dtype)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    start = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, position_ids=context + depths.long(), use_cache=True,
          **{cache_kw: cache})
    ms = 1e3 * (time.perf_counter() - start)
    _drop_last(cache, tokens)
    return ms


_CACHES: dict = {}


def attention_times(model: torch.nn.Module, tokens: list[int], contexts: list[int], reps: int) -> list[dict]:
    """:func:`tree_forward_ms` through SDPA and through the packed attention, in turn."""
    dtype = next(model.parameters()).dtype
    out = []
    for ctx in contexts:
        for n in tokens:
            samples = {"sdpa": [], "packed": []}
            for rep in range(reps + 1):  # the first round warms up
                for kind in samples:
                    (use_packed_attention if kind == "packed" else restore_sdpa_attention)(model)
                    ms = tree_forward_ms(model, n, ctx)
                    if rep:
                        samples[kind].append(ms)
            a, b = (statistics.median(samples[k]) for k in ("sdpa", "packed"))
            out.append({"context": ctx, "tokens": n, "sdpa_ms": round(a, 2), "packed_ms": round(b, 2),
                        "ratio": round(a / b, 3)})
            print(f"  {str(dtype)[6:]:9s} context {ctx:4d}, {n:3d} tokens: sdpa {a:6.1f} ms  packed {b:6.1f} ms  "
                  f"sdpa / packed {a / b:.2f}", flush=True)
    use_packed_attention(model)
    return out


@torch.no_grad()
def drafter_times(target: torch.nn.Module, positions: list[int], context: int, reps: int) -> list[dict]:
    """The shipped drafter's pass after ``context`` committed slots (their keys and values kept, as
    the decoder keeps them), for the first p positions and for all of them, in turn (median of
    ``reps`` after a warm-up round); the drafter set up like the target (its linear layers)."""
    from dartree_ext.loading import load_drafter, shipped_drafter
    drafter = load_drafter(shipped_drafter("SmolLM2-135M-Instruct"), target)   # a SmolLM2-shaped target
    cfg, gen = drafter.config, torch.Generator().manual_seed(0)
    ctx = torch.randn(1, context, cfg.hidden_size, generator=gen).to(drafter.dtype)
    cpos, cmask = torch.arange(context)[None], torch.ones(1, context, dtype=torch.bool)
    root, rpos = torch.randint(0, cfg.vocab_size, (1,), generator=gen), torch.tensor([context])
    ctx_kv = drafter.context_kv(ctx, cpos)  # kept per slot by the decoder, not recomputed per round
    full = cfg.block_size - 1
    samples: dict[int, list[float]] = {p: [] for p in [*positions, full]}
    for rep in range(reps + 1):
        for p in samples:
            start = time.perf_counter()
            drafter(root, rpos, ctx, cpos, cmask, ctx_kv, positions=None if p == full else p)
            if rep:
                samples[p].append(1e3 * (time.perf_counter() - start))
    all_ms = statistics.median(samples[full])
    out = []
    for p in samples:
        ms = statistics.median(samples[p])
        out.append({"positions": p, "ms": round(ms, 3), "all_over_this": round(all_ms / ms, 3)})
        print(f"  {p:2d} positions: {ms:6.2f} ms  (all {full} / this: {all_ms / ms:.2f})", flush=True)
    return out


@torch.no_grad()
def prefill_tokens_per_s(model: torch.nn.Module, tokens: int = 256) -> float:
    """Tokens per second of one forward over ``tokens`` fresh tokens (second of two calls)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(ids)
    start = time.perf_counter()
    model(ids)
    return tokens / (time.perf_counter() - start)


def layer_times(model: torch.nn.Module, rows: list[int], reps: int = 15) -> list[dict]:
    """Every linear weight of ``model`` (bfloat16, model order) through ``few_rows_linear`` (and,
    where this CPU has them, its FMA and VDPBF16PS paths forced) at each row count; the counts and
    implementations in turn ``reps`` times (the implementations' order flipped every repetition):
    median and fastest ms of one pass over the weights, and the median over repetitions of the
    FMA path's time over VDPBF16PS's (paired: the two ran back to back)."""
    gen = torch.Generator().manual_seed(0)
    weights = [m.weight.detach().to(torch.bfloat16) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {n: {w.shape[1]: torch.randn(n, w.shape[1], generator=gen).to(torch.bfloat16) for w in weights} for n in rows}
    impls = {"few_rows": lambda x, w: ops.few_rows_linear(x, w), **_forced_paths(torch.bfloat16)}

    def one_pass(f, n: int) -> float:
        start = time.perf_counter()
        for w in weights:
            f(xs[n][w.shape[1]], w)
        return 1e3 * (time.perf_counter() - start)

    for n in rows:  # warm-up
        for f in impls.values():
            one_pass(f, n)
    times = {(name, n): [] for name in impls for n in rows}
    for rep in range(reps):
        for n in rows:
            for name, f in (list(impls.items()) if rep % 2 else list(impls.items())[::-1]):
                times[(name, n)].append(one_pass(f, n))
    print(f"  {len(weights)} layers ({sum(w.numel() for w in weights) / 1e6:.1f}M weights), median ms (fastest):")
    out = []
    for n in rows:
        row = {"rows": n}
        for name in impls:
            t = times[(name, n)]
            row[f"{name}_median_ms"], row[f"{name}_min_ms"] = round(statistics.median(t), 2), round(min(t), 2)
        if "avx512_fma" in impls and "avx512_bf16" in impls:
            row["fma_over_dot"] = round(statistics.median(
                a / b for a, b in zip(times[("avx512_fma", n)], times[("avx512_bf16", n)])), 3)
        out.append(row)
        print(f"  rows {n:3d}: " + "  ".join(f"{name} {row[f'{name}_median_ms']:.1f} ({row[f'{name}_min_ms']:.1f})"
                                             for name in impls) +
              (f"  fma / dot {row['fma_over_dot']:.3f}" if "fma_over_dot" in row else ""))
    return out


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
    p.add_argument("--attention", default="", help="tree sizes (tokens incl. the root) for the attention part, "
                   "e.g. 1,4,8,16 ('' skips it); each dtype with the linear layers torch/few_rows as --linear says")
    p.add_argument("--contexts", default="200,800", help="the attention part's cache lengths")
    p.add_argument("--linear", default="few_rows", choices=LINEAR_KINDS, help="the attention and drafter parts' "
                   "linear layers")
    p.add_argument("--drafter-positions", default="", help="drafted positions for the drafter part, e.g. 2,4,6,8 "
                   "('' skips it): the shipped SmolLM2 drafter in bfloat16 after a --drafter-context slot context")
    p.add_argument("--drafter-context", type=int, default=300)
    p.add_argument("--layers", default="", help="row counts for the target's own linear layers through "
                   "few_rows_linear in bfloat16 and its forced FMA / VDPBF16PS paths (where the CPU has them), "
                   "e.g. 1,4,8,12,16 ('' skips it)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows, tokens, threads = _ints(args.rows), _ints(args.tokens), _ints(args.threads)
    tree_sizes, contexts, draft_positions = _ints(args.attention), _ints(args.contexts), _ints(args.drafter_positions)
    layer_rows = _ints(args.layers)
    result = {"device": device_name("cpu"), "bf16_native": cpu_bf16_native(), "torch": torch.__version__,
              "few_rows_linear": build_info()["few_rows_linear"], "runs": []}
    print(f"{result['device']} (bf16 native: {result['bf16_native']}), few_rows paths {result['few_rows_linear']}")
    models = {dtype: load_target(args.target, dtype=dtype).target for dtype in DTYPES} \
        if tokens or args.prefill or tree_sizes or draft_positions or layer_rows else {}
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        run = {"threads": n_threads, "op": {}, "forward": {}, "prefill_tok_s": {}, "attention": {}, "drafter": [],
               "layers": []}
        print(f"{n_threads} threads")
        if rows:
            print("60 x [1536, 576] weights:")
            for dtype in DTYPES:
                run["op"][str(dtype)[6:]] = op_times(dtype, rows)
        if tokens:
            print(f"{args.target} forward after a 200-token cache:")
            for dtype, model in models.items():
                run["forward"][str(dtype)[6:]] = forward_times(model, tokens, args.reps)
        if tree_sizes:
            print(f"{args.target} tree verification forward ({args.linear} linear layers), SDPA vs packed attention:")
            for dtype, model in models.items():
                set_linear(model, args.linear)
                run["attention"][str(dtype)[6:]] = attention_times(model, tree_sizes, contexts, args.reps)
                set_linear(model, "torch")
        if draft_positions:
            print(f"shipped drafter pass (bfloat16, {args.linear} linear layers), {args.drafter_context}-slot context:")
            set_linear(models[torch.bfloat16], args.linear)
            run["drafter"] = drafter_times(models[torch.bfloat16], draft_positions, args.drafter_context, args.reps)
            set_linear(models[torch.bfloat16], "torch")
        if layer_rows:
            print(f"{args.target} linear layers through few_rows_linear (bfloat16):")
            run["layers"] = layer_times(models[torch.bfloat16], layer_rows)
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
