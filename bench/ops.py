"""Microbenchmarks: every op against its pure-PyTorch reference, side by side in one run.

    python bench/ops.py                 # CPU, and CUDA when present
    python bench/ops.py --device cpu --batch 8 --nodes 65 193 --past 256

Prints a markdown table: median time per call of ours and of the reference, the ratio, and the
size of the op's output (plus peak allocated memory on CUDA).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import dartree_ext
from dartree_ext import ops, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))
from trees import random_batch  # noqa: E402


@dataclass
class Row:
    op: str
    device: str
    batch: int
    nodes: int
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
    yield ("tree_ancestor_bits", lambda: ops.tree_ancestor_bits(parents, num_nodes),
           lambda: reference.tree_ancestor_bits(parents, num_nodes))
    yield (f"tree_attention_mask (P={past}, fp32)",
           lambda: ops.tree_attention_mask(parents, num_nodes, past_key_mask, torch.float32),
           lambda: reference.tree_attention_mask(parents, num_nodes, past_key_mask, torch.float32))
    yield ("tree_links", lambda: ops.tree_links(parents, num_nodes), lambda: reference.tree_links(parents, num_nodes))
    yield ("verify_tree", lambda: ops.verify_tree(tokens, parents, num_nodes, target),
           lambda: reference.verify_tree(tokens, parents, num_nodes, target))


def run(devices: list[str], batches: list[int], nodes: list[int], past: int) -> list[Row]:
    rows = []
    for dev_name in devices:
        device = torch.device(dev_name)
        for batch in batches:
            for n_max in nodes:
                for name, ours, ref in cases(batch, n_max, past, device):
                    out = ours()
                    expected = ref()
                    same = all(torch.equal(a, b) for a, b in zip(
                        out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)))
                    if not same:
                        raise AssertionError(f"{name} on {dev_name}: ours and the reference disagree")
                    peak_ours, peak_ref = _peak_mb(ours, device), _peak_mb(ref, device)
                    peak = "-" if peak_ours is None else f"{peak_ours:.2f} / {peak_ref:.2f}"
                    rows.append(Row(name, dev_name, batch, n_max, median_time_us(ours, device),
                                    median_time_us(ref, device), _output_mb(out), peak))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| op | device | B | N | ours (us) | reference (us) | speedup | output (MiB) | peak ours / ref (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.device} | {r.batch} | {r.nodes} | {r.ours_us:.1f} | {r.reference_us:.1f} | "
                     f"{r.speedup:.1f}x | {r.output_mb:.3f} | {r.peak_mb} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dartree_ext.build_info()["cuda"] else [])
    parser.add_argument("--device", nargs="+", default=default_devices)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[65, 193])
    parser.add_argument("--past", type=int, default=256, help="cached positions in the attention mask")
    args = parser.parse_args(argv)
    info = dartree_ext.build_info()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dartree_ext CUDA kernels: {info['cuda']}")
    if "cuda" in args.device:
        print(f"GPU: {torch.cuda.get_device_name()}")
    print(format_table(run(args.device, args.batch, args.nodes, args.past)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
