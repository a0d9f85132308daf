"""Per-kernel GPU time of one DARTree supertree expansion (``build_supertree``: D = 16 depths,
K = 64, W = 12) at the paper's head shapes, from the CUDA profiler: which of the kernels per
depth (expand_hidden, expand_logits, expand_select, expand_update) dominates, and the round's GPU time
against its wall time (the difference is launch overhead).

    python bench/ops/expand_kernels.py --batch 1 8 64
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dartree_ext import ops
from dartree_ext.head import CorrectionHeadWeights

DEPTH, K, WIDTH, BONUS = 16, 64, 12, -0.2
KERNELS = ("expand_hidden", "expand_logits", "expand_select", "expand_update")  # a build without one shows 0
HEADS = {"0.1B": dict(hidden=576, vocab=49152, e=256, g=256, dtype=torch.float32),
         "4B": dict(hidden=2560, vocab=151936, e=512, g=512, dtype=torch.bfloat16)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    print(f"| head | batch | wall us/round | GPU us/round | {' | '.join(KERNELS)} | other |")
    print("|---|---|---|---|" + "---|" * (len(KERNELS) + 1))
    for name in a.heads:
        spec = HEADS[name]
        for batch in a.batch:
            gen = torch.Generator().manual_seed(0)
            head = CorrectionHeadWeights.random(spec["vocab"], spec["hidden"], spec["e"], spec["g"], dtype=spec["dtype"],
                                                device=dev, seed=0)
            z = head.project(torch.randn(batch, DEPTH, spec["hidden"], generator=gen).to(dev)).contiguous()
            cand_ids = torch.stack([torch.randperm(spec["vocab"], generator=gen)[:K] for _ in range(batch * DEPTH)])
            cand_ids = cand_ids.view(batch, DEPTH, K).to(dev)
            cand_base = (torch.randn(batch, DEPTH, K, generator=gen) * 2).to(device=dev, dtype=spec["dtype"])
            root = torch.randn(batch, spec["g"], generator=gen).to(device=dev, dtype=spec["dtype"])

            def run():
                return ops.build_supertree(head, z, cand_ids, cand_base, root, WIDTH, BONUS)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                run()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.reps * 1e6
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.reps):
                    run()
                torch.cuda.synchronize()
            per = defaultdict(float)
            for ev in prof.events():
                if ev.device_type.name != "CUDA":
                    continue
                key = next((k for k in KERNELS if k in ev.name), "other")
                per[key] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            total = sum(per.values()) / a.reps
            cells = " | ".join(f"{per[k] / a.reps:.0f}" for k in KERNELS + ("other",))
            print(f"| {name} | {batch} | {wall:.0f} | {total:.0f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
