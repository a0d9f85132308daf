"""Microbenchmarks: every op against its pure-PyTorch reference, side by side in one run.

    python bench/ops/ops.py                 # CPU, and CUDA when present
    python bench/ops/ops.py --device cpu --batch 8 --nodes 65 193 --past 256 --only tree
    python bench/ops/ops.py --only select --select-batch 1 8 32

Tree ops run at each --batch and --nodes; selection ops at the shapes of the DARTree paper:
select_top_w at P = 12 parents x K = 64 candidates -> W = 12, select_top_b on a 16 x 12 = 192-node
supertree (plus root) -> B = 64, and ddtree_heap with D = 16, K = 64 at budgets 64, 256, 1024.
`--only attention` (CPU): few_rows_attention against the packed SDPA it replaces
(`dartree_ext.attention.gqa_attention`), SmolLM2's heads (9 over 3, head dim 64), bfloat16, --past
cached keys, --attention-rows query rows under a tree mask. `--only rows` (CPU): the per-row steps
of the target's layers (rms_norm_rows, rotary_tables, silu_mul, quant_linear, amx_linear, the greedy tokens_from_logits) at
SmolLM2's shapes in bfloat16 against their PyTorch forms, at --row-counts rows (1: a plain step,
9: a tree, 37: the main command's prefill), and silu_mul through each build the CPU runs.
`--only validate`: each wrapper with its data checks (`validate=True`, the default; "ours") against
`validate=False` ("reference"), at --select-batch requests: the checks' cost, a ratio below 1.

Prints a markdown table: median time per call of ours and of the reference, the ratio, and the
size of the op's output (plus peak allocated memory on CUDA).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import dartree_ext
from dartree_ext import ops, reference
from dartree_ext.head import CorrectionHeadWeights
from dartree_ext.testing import random_batch


@dataclass
class Row:
    op: str
    device: str
    batch: int
    shape: str
    ours_us: float
    reference_us: float
    output_mb: float
    peak_mb: str

    @property
    def speedup(self) -> float:
        return self.reference_us / self.ours_us


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time_us(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.3,
                   max_reps: int = 2000) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    samples = []
    start = time.perf_counter()
    while len(samples) < max_reps and (time.perf_counter() - start < min_seconds or len(samples) < 10):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _output_mb(out) -> float:
    tensors = out if isinstance(out, tuple) else (out,)
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _peak_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def cases(batch: int, n_max: int, past: int, device: torch.device):
    parents, num_nodes = random_batch(batch, n_max, seed=n_max, kind="bushy", full=True)
    gen = torch.Generator().manual_seed(0)
    past_key_mask = torch.rand(batch, past, generator=gen) < 0.9
    tokens = torch.randint(0, 4, (batch, n_max), generator=gen)
    target = torch.randint(0, 4, (batch, n_max), generator=gen)
    parents, num_nodes, past_key_mask, tokens, target = (
        t.to(device) for t in (parents, num_nodes, past_key_mask, tokens, target))
    yield ("tree_ancestor_bits", lambda: ops.tree_ancestor_bits(parents, num_nodes, validate=False),
           lambda: reference.tree_ancestor_bits(parents, num_nodes))
    yield (f"tree_attention_mask (P={past}, fp32)",
           lambda: ops.tree_attention_mask(parents, num_nodes, past_key_mask, torch.float32, validate=False),
           lambda: reference.tree_attention_mask(parents, num_nodes, past_key_mask, torch.float32))
    yield ("tree_links", lambda: ops.tree_links(parents, num_nodes, validate=False), lambda: reference.tree_links(parents, num_nodes))
    yield ("verify_tree", lambda: ops.verify_tree(tokens, parents, num_nodes, target, validate=False),
           lambda: reference.verify_tree(tokens, parents, num_nodes, target))


def supertree(batch: int, depth: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A DARTree-shaped supertree: `width` nodes per depth, each child of a random node of the
    previous depth, with scores that never increase along a path (depth bonus -0.2)."""
    parents = torch.full((batch, 1 + depth * width), -1, dtype=torch.int32)
    parents[:, 1: 1 + width] = 0
    for d in range(1, depth):
        first_prev = 1 + (d - 1) * width
        parents[:, 1 + d * width: 1 + (d + 1) * width] = first_prev + torch.randint(0, width, (batch, width),
                                                                                     generator=gen, dtype=torch.int32)
    step = torch.log(torch.rand(batch, 1 + depth * width, generator=gen)) - 0.2
    scores = torch.zeros(batch, 1 + depth * width)
    for i in range(1, scores.shape[1]):
        scores[:, i] = scores.gather(1, parents[:, i:i + 1].long())[:, 0] + step[:, i]
    return parents, scores, torch.full((batch,), parents.shape[1], dtype=torch.int32)


def select_cases(batch: int, device: torch.device, heap_budgets: list[int]):
    gen = torch.Generator().manual_seed(batch)
    parent_scores = torch.randn(batch, 12, generator=gen).to(device)
    child_logprobs = torch.log_softmax(torch.randn(batch, 12, 64, generator=gen), -1).to(device)
    num_parents = torch.full((batch,), 12, dtype=torch.int32, device=device)
    yield ("select_top_w", "P=12 K=64 W=12", lambda: ops.select_top_w(parent_scores, child_logprobs, num_parents, 12, validate=False),
           lambda: reference.select_top_w(parent_scores, child_logprobs, num_parents, 12))
    parents, scores, num_nodes = (t.to(device) for t in supertree(batch, 16, 12, gen))
    yield ("select_top_b", "N=193 -> B=64", lambda: ops.select_top_b(parents, scores, num_nodes, 64, validate=False),
           lambda: reference.select_top_b(parents, scores, num_nodes, 64))
    logprobs = torch.sort(torch.log_softmax(torch.randn(batch, 16, 64, generator=gen), -1), -1, descending=True).values
    token_ids = torch.randint(0, 49152, (batch, 16, 64), generator=gen)
    roots = torch.randint(0, 49152, (batch,), generator=gen)
    logprobs, token_ids, roots = logprobs.to(device), token_ids.to(device), roots.to(device)
    for budget in heap_budgets:
        yield ("ddtree_heap", f"D=16 K=64 B={budget}", lambda b=budget: ops.ddtree_heap(logprobs, token_ids, roots, b, validate=False),
               lambda b=budget: reference.ddtree_heap(logprobs, token_ids, roots, b))


def validate_cases(batch: int, device: torch.device):
    """Each wrapper with ``validate=True`` (the default; the "ours" column) against
    ``validate=False`` (the "reference" column): the cost of the data checks at the decoding
    loop's shapes (a 65-node tree, the selection ops' shapes above)."""
    parents, num_nodes = random_batch(batch, 65, seed=65, kind="bushy", full=True)
    gen = torch.Generator().manual_seed(batch)
    mask = torch.rand(batch, 256, generator=gen) < 0.9
    tokens, target = (torch.randint(0, 4, (batch, 65), generator=gen) for _ in range(2))
    parents, num_nodes, mask, tokens, target = (t.to(device) for t in (parents, num_nodes, mask, tokens, target))
    calls = {"tree_attention_mask": lambda v: ops.tree_attention_mask(parents, num_nodes, mask, validate=v),
             "verify_tree": lambda v: ops.verify_tree(tokens, parents, num_nodes, target, validate=v)}
    ps = torch.randn(batch, 12, generator=gen).to(device)
    cl = torch.log_softmax(torch.randn(batch, 12, 64, generator=gen), -1).to(device)
    npar = torch.full((batch,), 12, dtype=torch.int32, device=device)
    sp, ss, sn = (t.to(device) for t in supertree(batch, 16, 12, gen))
    lp = torch.sort(torch.log_softmax(torch.randn(batch, 16, 64, generator=gen), -1), -1, descending=True).values
    ids, roots = torch.randint(0, 49152, (batch, 16, 64), generator=gen), torch.randint(0, 49152, (batch,), generator=gen)
    lp, ids, roots = lp.to(device), ids.to(device), roots.to(device)
    calls.update({"select_top_w": lambda v: ops.select_top_w(ps, cl, npar, 12, validate=v),
                  "select_top_b": lambda v: ops.select_top_b(sp, ss, sn, 64, validate=v),
                  "ddtree_heap": lambda v: ops.ddtree_heap(lp, ids, roots, 64, validate=v)})
    # the supertree at the 0.1B drafter's head (E = G = 256, vocabulary 49152), D = 16, K = 64, W = 12
    head = CorrectionHeadWeights.random(49152, 576, 256, 256, device=device)
    z = torch.randn(batch, 16, 256, generator=gen).to(device)
    cand = torch.randint(0, 49152, (batch, 16, 64), generator=gen).to(device)
    base = torch.randn(batch, 16, 64, generator=gen).to(device)
    root = torch.randn(batch, 256, generator=gen).to(device)
    calls["build_supertree"] = lambda v: ops.build_supertree(head, z, cand, base, root, 12, validate=v)
    for name, call in calls.items():
        yield f"{name}: validate=True vs False", "loop shapes", (lambda c=call: c(True)), (lambda c=call: c(False))


def measure(name: str, shape: str, batch: int, dev_name: str, ours, ref, atol: float = 0.0) -> Row:
    """Times ``ours`` and ``ref`` after checking they agree: equal, or within ``atol`` (a
    floating-point op against a different kernel)."""
    device = torch.device(dev_name)
    out = ours()
    expected = ref()
    same = all((torch.equal(a, b) if not atol else torch.allclose(a.float(), b.float(), atol=atol)) for a, b in zip(
        out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)))
    if not same:
        raise AssertionError(f"{name} {shape} on {dev_name}: ours and the reference disagree")
    peak_ours, peak_ref = _peak_mb(ours, device), _peak_mb(ref, device)
    peak = "-" if peak_ours is None else f"{peak_ours:.2f} / {peak_ref:.2f}"
    return Row(name, dev_name, batch, shape, median_time_us(ours, device), median_time_us(ref, device),
               _output_mb(out), peak)


def kv_cases(batch: int, device: torch.device):
    """compact_kv_ on one layer of a SmolLM2-135M-shaped cache (3 KV heads x 64, 1024 slots), 17
    accepted entries per request (a full 16-position path plus the root) after a 700-token prefix;
    compact_kv_layers_ on all 30 layers against compact_kv_ called per layer (the "reference"
    column of that row)."""
    gen = torch.Generator().manual_seed(batch)
    keys = torch.randn(batch, 3, 1024, 64, generator=gen).to(device)
    values = torch.randn(batch, 3, 1024, 64, generator=gen).to(device)
    src = torch.stack([torch.sort(torch.randperm(64, generator=gen)[:17]).values + 700 for _ in range(batch)])
    src, dst = src.to(device), torch.full((batch,), 700, dtype=torch.int64, device=device)
    lengths = torch.full((batch,), 17, dtype=torch.int32, device=device)
    ours_k, ours_v, ref_k, ref_v = keys.clone(), values.clone(), keys.clone(), values.clone()
    yield ("compact_kv_", "H=3 S=1024 Dh=64 L=17",
           lambda: (ops.compact_kv_(ours_k, ours_v, src, dst, lengths), ours_k)[1],
           lambda: (reference.compact_kv_(ref_k, ref_v, src, dst, lengths), ref_k)[1])
    # every layer of the same cache (30 layers x K and V) in one call, against compact_kv_ per layer
    layers = [torch.randn(batch, 3, 1024, 64, generator=gen).to(device) for _ in range(60)]
    ours_all, per_layer = [t.clone() for t in layers], [t.clone() for t in layers]

    def each_layer():
        for k in range(0, 60, 2):
            ops.compact_kv_(per_layer[k], per_layer[k + 1], src, dst, lengths)
        return per_layer[-1]
    yield ("compact_kv_layers_ vs compact_kv_ x 30", "30 x (K, V) H=3 S=1024 Dh=64 L=17",
           lambda: (ops.compact_kv_layers_(ours_all, src, dst, lengths), ours_all[-1])[1], each_layer)


def attention_cases(past: int, rows: list[int]):
    """few_rows_attention against packed SDPA: a verification forward's shapes (9 query heads over 3
    key/value heads, head dim 64, bfloat16), the last T of the `past` keys a causal tree's."""
    from dartree_ext.attention import gqa_attention
    gen = torch.Generator().manual_seed(0)
    for t in rows:
        q = torch.randn(1, 9, t, 64, generator=gen).bfloat16()
        k, v = (torch.randn(1, 3, past, 64, generator=gen).bfloat16() for _ in range(2))
        visible = torch.ones(1, 1, t, past, dtype=torch.bool)
        visible[..., past - t:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
        mask = torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
        yield (f"few_rows_attention vs packed SDPA (S={past}, bf16)", f"T={t}",
               lambda q=q, k=k, v=v, m=mask: ops.few_rows_attention(q, k, v, m),
               lambda q=q, k=k, v=v, m=mask: gqa_attention(q, k, v, m))


def row_cases(row_counts: list[int]):
    """The target's per-row steps at SmolLM2's shapes (hidden 576, 9 query / 3 key-value heads of
    64, MLP 1536, vocabulary 49152), bfloat16, against the PyTorch forms they replace; silu_mul
    also through each build this CPU runs (``silu_mul_build``: AVX-512, AVX2, baseline)."""
    gen = torch.Generator().manual_seed(0)
    builds = []
    for build in ("avx512", "avx2", "base"):
        try:
            torch.ops.dartree_ext.silu_mul_build(torch.ones(1), torch.ones(1), build)
            builds.append(build)
        except (RuntimeError, AttributeError):  # not this CPU, or a build without the op
            pass
    for t in row_counts:
        x = torch.randn(1, t, 576, generator=gen).bfloat16()
        w = torch.randn(576, generator=gen).bfloat16()
        yield "rms_norm_rows vs PyTorch's RMSNorm", f"T={t} h=576", (lambda x=x, w=w: ops.rms_norm_rows(x, w, 1e-5),
                                                                    lambda x=x, w=w: reference.rms_norm_rows(x, w, 1e-5))
        q = torch.randn(1, 9, t, 64, generator=gen).bfloat16()
        k = torch.randn(1, 3, t, 64, generator=gen).bfloat16()
        ang = torch.arange(t)[None, :, None] * torch.logspace(0, -4, 64)[None, None]
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        yield "rotary_tables vs apply_rotary_pos_emb", f"T={t} 9+3 heads", (
            lambda q=q, k=k, c=cos, s_=sin: ops.rotary_tables(q, k, c, s_),
            lambda q=q, k=k, c=cos, s_=sin: reference.rotary_tables(q, k, c, s_))
        gate, up = (torch.randn(1, t, 1536, generator=gen).bfloat16() for _ in range(2))
        yield "silu_mul vs silu(gate) * up", f"T={t} 1536", (lambda g=gate, u=up: ops.silu_mul(g, u),
                                                             lambda g=gate, u=up: reference.silu_mul(g, u))
        for build in builds:
            yield f"silu_mul ({build} build) vs silu(gate) * up", f"T={t} 1536", (
                lambda g=gate, u=up, b=build: torch.ops.dartree_ext.silu_mul_build(g, u, b),
                lambda g=gate, u=up: reference.silu_mul(g, u))
        from dartree_ext.quant import dequantize, quantize
        blocks = quantize(torch.randn(1536, 576, generator=gen), "q4_1")
        dense = dequantize(blocks, "q4_1")
        xq = torch.randn(t, 576, generator=gen)
        yield "quant_linear (q4_1) vs de-quantize + F.linear", f"T={t} 1536x576", (
            lambda x=xq, b=blocks: ops.quant_linear(x, b, "q4_1"), lambda x=xq, b=blocks: reference.quant_linear(x, b, "q4_1"))
        yield "quant_linear (q4_1) vs F.linear on the dense weights", f"T={t} 1536x576", (
            lambda x=xq, b=blocks: ops.quant_linear(x, b, "q4_1"),
            lambda x=xq, w=dense: torch.nn.functional.linear(x, w))
        if dartree_ext.build_info().get("amx_linear") == "amx_bf16":
            wb, xb = dense.bfloat16(), xq.bfloat16()
            packed = ops.pack_amx(wb)
            yield "amx_linear vs F.linear (bf16)", f"T={t} 1536x576", (
                lambda x=xb, p=packed: ops.amx_linear(x, p, 1536), lambda x=xb, w=wb: torch.nn.functional.linear(x, w))
            yield "amx_linear vs few_rows_linear (bf16)", f"T={t} 1536x576", (
                lambda x=xb, p=packed: ops.amx_linear(x, p, 1536), lambda x=xb, w=wb: ops.few_rows_linear(x, w))
        logits = torch.randn(t, 49152, generator=gen).bfloat16()
        yield "tokens_from_logits (greedy) vs argmax", f"T={t} V=49152", (
            lambda z=logits: ops.tokens_from_logits(z, None, 0.0), lambda z=logits: reference.tokens_from_logits(z, None, 0.0))


def run(devices: list[str], batches: list[int], nodes: list[int], past: int, select_batches: list[int],
        heap_budgets: list[int], only: str | None, attention_rows: list[int] = (1, 9, 17, 33),
        row_counts: list[int] = (1, 9, 37)) -> list[Row]:
    rows = []
    for dev_name in devices:
        device = torch.device(dev_name)
        if only == "attention":
            if device.type == "cpu":
                for name, shape, ours, ref in attention_cases(past, attention_rows):
                    rows.append(measure(name, shape, 1, dev_name, ours, ref, atol=2e-2))
            continue
        if only == "rows":
            if device.type == "cpu":
                for name, shape, (ours, ref) in row_cases(row_counts):
                    rows.append(measure(name, shape, 1, dev_name, ours, ref, atol=0.07))
            continue
        if only == "validate":
            for batch in select_batches:
                for name, shape, ours, ref in validate_cases(batch, device):
                    rows.append(measure(name, shape, batch, dev_name, ours, ref))
            continue
        if only in (None, "select"):
            for batch in select_batches:
                for name, shape, ours, ref in select_cases(batch, device, heap_budgets):
                    rows.append(measure(name, shape, batch, dev_name, ours, ref))
                for name, shape, ours, ref in kv_cases(batch, device):
                    rows.append(measure(name, shape, batch, dev_name, ours, ref))
        if only not in (None, "tree"):
            continue
        for batch in batches:
            for n_max in nodes:
                for name, ours, ref in cases(batch, n_max, past, device):
                    rows.append(measure(name, f"N={n_max}", batch, dev_name, ours, ref))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| op | device | batch | shape | ours (us) | reference (us) | speedup | output (MiB) | peak ours / ref (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.device} | {r.batch} | {r.shape} | {r.ours_us:.1f} | {r.reference_us:.1f} | "
                     f"{r.speedup:.1f}x | {r.output_mb:.3f} | {r.peak_mb} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dartree_ext.build_info()["cuda"] else [])
    parser.add_argument("--device", nargs="+", default=default_devices)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[65, 193])
    parser.add_argument("--past", type=int, default=256, help="cached positions in the attention mask")
    parser.add_argument("--select-batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--heap-budget", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--only", choices=["tree", "select", "attention", "rows", "validate"], default=None)
    parser.add_argument("--attention-rows", type=int, nargs="+", default=[1, 9, 17, 33])
    parser.add_argument("--row-counts", type=int, nargs="+", default=[1, 9, 37], help="--only rows: rows per call")
    args = parser.parse_args(argv)
    info = dartree_ext.build_info()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dartree_ext CUDA kernels: {info['cuda']}")
    if "cuda" in args.device:
        print(f"GPU: {torch.cuda.get_device_name()}")
    print(format_table(run(args.device, args.batch, args.nodes, args.past, args.select_batch, args.heap_budget,
                           args.only, args.attention_rows, args.row_counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
