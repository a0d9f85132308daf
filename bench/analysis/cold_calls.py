"""How long a small call takes right after the process has spent some milliseconds elsewhere.

A decoding round runs a few dozen small host calls (the drafter's pass, the tree, the chooser,
the bookkeeping) right after the target's forward, which takes about 20 ms on a 2-vCPU CPU. This
times four small calls (a pure-Python sum over 200 ints, one NumPy add, one torch add, three
torch adds) right after a busy wait of 0 to 20 ms in plain Python (nothing streamed from memory),
median over ``--reps`` tries each.

    python bench/analysis/cold_calls.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def spin(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    x, a = torch.randn(1, 5, 64), np.random.rand(5, 64)
    calls = {"python sum": lambda: sum(range(200)), "np.add": lambda: np.add(a, 1), "torch.add": lambda: torch.add(x, 1),
             "3 x torch.add": lambda: (torch.add(x, 1), torch.add(x, 1), torch.add(x, 1))}
    print("us per call (median of %d) after a busy wait of:" % args.reps)
    print(f"{'wait ms':>8s} " + " ".join(f"{name:>14s}" for name in calls))
    for wait in (0.0, 0.001, 0.002, 0.005, 0.01, 0.02):
        cells = []
        for call in calls.values():
            times = []
            for _ in range(args.reps):
                spin(wait)
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            cells.append(f"{1e6 * statistics.median(times):14.1f}")
        print(f"{1e3 * wait:8.0f} " + " ".join(cells))


if __name__ == "__main__":
    main()
