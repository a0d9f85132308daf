"""quant_linear_int8 at SmolLM2-135M's layer shapes (q4_1 blocks): microseconds a call and GMAC/s
at 1-16 rows, 30 distinct weights a shape (more than the caches hold), best of 7 passes.

    python bench/ops/quant_int8_shapes.py

[1536, 512] has whole groups of 16 blocks only; [1536, 576] (q / k / v / o / gate / up and the
output head's width) a last group of 2 blocks; [576, 1536] is down_proj.
"""
from __future__ import annotations

import time

import torch

from dartree_ext import quant
from dartree_ext.decoding.profiling import device_name


def main() -> int:
    torch.manual_seed(0)
    op = torch.ops.dartree_ext.quant_linear_int8.default
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads")
    for out, inp in ((1536, 512), (1536, 576), (576, 1536), (1536, 1024)):
        packs = [quant.pack_int8(quant.quantize(torch.randn(out, inp) * 0.05, "q4_1"), "q4_1") for _ in range(30)]
        line = []
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, inp)
            best = float("inf")
            for _ in range(7):
                t = time.perf_counter()
                for b in packs:
                    op(x, b, "q4_1", None)
                best = min(best, time.perf_counter() - t)
            us = best / len(packs) * 1e6
            line.append(f"r{rows}: {us:.1f} us {out * inp * rows / us / 1e3:.1f} GMAC/s")
        print(f"[{out}, {inp}]", " | ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
