"""How repeatable the measured cost model is, and what its noise costs: the target's verification
curve sampled --runs times (the target set up as `dartree-generate` sets it up; each run --reps
pairs of a plain step and a tree, back to back, for every size), each fit applied to groups of
--groups pairs as the decoder's measurement would see them, and for each fitted curve the tree
size the chooser picks for a measured acceptance profile. The reference a group is scored against:
the mean plain step plus the mean of each size's differences over every pair of the other runs
(so no fit is scored against its own data, and the reference is none of the fits). The loss:
how much slower, in tokens per ms under the reference, the chosen size is than the reference's
best.

    python bench/analysis/cost_curve.py                                      # 3 runs of 20 pairs a size
    python bench/analysis/cost_curve.py --json bench/results/<cpu>/cost_curve.json

Fits: `paired` and `fastest` (`dartree_ext.decoding.profiling.fit_curve`; `fastest` here reads the
plain step's fastest time over all the group's pairs, more samples than each size has), and
`spline` (a candidate kept here: the paired medians least-squares fitted to a linear spline with
knots at 0, 1, 16, 32 and 64 nodes, those up to the largest size measured).

The profile PROFILE: E[accepted] of the best n nodes, the mean over the rounds of two greedy
decodes of the main command's haiku with the shipped drafter (`dartree`, SmolLM2-135M bf16,
AMD EPYC Zen 4); the drafter pass plus tree at --drafted-ms and the bookkeeping at
--overhead-ms (what the decoder measured there).
"""
from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from dartree_ext.cli import _load_for_generate, build_generate_parser
from dartree_ext.decoding.calibration import isotonic
from dartree_ext.decoding.cost import CostModel, choose_size
from dartree_ext.decoding.profiling import _curve_samples, _Timer, fit_curve

PROFILE = (0.0, 0.385, 0.555, 0.676, 0.756, 0.822, 0.87, 0.908, 0.945, 0.979, 1.013, 1.044, 1.074, 1.103, 1.129,
           1.153, 1.173)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def spline_fit(nodes, pairs, knots=(0, 1, 16, 32, 64)):
    """The paired medians least-squares fitted to a linear spline over ``knots``, then isotonic."""
    import numpy as np
    xs = list(nodes[1:])
    ys = [statistics.median(t - p for p, t in pairs[n]) for n in xs]
    ks = [k for k in knots if k <= max(nodes)]
    basis = np.array([np.interp(x, ks, np.eye(len(ks))[j]) for x in [0] + xs for j in range(len(ks))])
    basis = basis.reshape(len(xs) + 1, len(ks))
    w = np.zeros(len(ks))
    w[1:] = np.linalg.lstsq(basis[1:, 1:], np.array(ys), rcond=None)[0]
    extra = isotonic(list(basis @ w))
    base = min(p for n in xs for p, _ in pairs[n])
    return [base + max(e, 0.0) for e in extra]


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--runs", type=int, default=3, help="measurements (each --reps pairs a size)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--groups", default="5,10", help="pairs a size per fit")
    parser.add_argument("--context", type=int, default=64, help="the context of the curve")
    parser.add_argument("--drafted-ms", type=float, default=3.0)
    parser.add_argument("--overhead-ms", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--pairs-from", default=None, metavar="JSON",
                        help="score the pairs saved in an earlier --json instead of timing new ones")
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    if args.runs < 2 or any(not 1 <= g <= args.reps for g in groups):
        parser.error(f"need --runs >= 2 (a group is scored against the other runs) and each of --groups in "
                     f"1..--reps, got {args.runs} and {groups}")
    nodes = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    raw = []
    if args.pairs_from:
        with open(args.pairs_from) as f:
            saved = json.load(f)
        raw = [{int(n): [tuple(p) for p in v] for n, v in run.items()} for run in saved["pairs"]][:args.runs]
        args.context, args.reps, dtype = saved["context"], min(len(v) for run in raw for v in run.values()), saved["dtype"]
        cpu, threads = saved["cpu"], saved["threads"]
        print(f"{len(raw)} runs of {args.reps} pairs a size from {args.pairs_from} ({cpu})")
    else:
        target, _, _, dtype, _, _, _ = _load_for_generate(args)
        cpu, threads = cpu_name(), torch.get_num_threads()
    fits = {"fastest": lambda nd, pr: fit_curve(nd, pr, "fastest"),
            "paired": lambda nd, pr: fit_curve(nd, pr, "paired"), "spline": spline_fit}
    with torch.no_grad():
        for r in range(args.runs if not raw else 0):
            start = time.perf_counter()
            raw.append(_curve_samples(target, True, nodes, [args.context], args.reps, False,
                                      _Timer(next(target.parameters()).device), torch.Generator().manual_seed(r))[0])
            print(f"run {r}: {args.reps} pairs a size in {time.perf_counter() - start:.1f} s", flush=True)

    def model(curve):
        return CostModel(nodes=nodes, contexts=[args.context], verify_ms=[curve])

    def chosen(cost):
        return choose_size(PROFILE, cost, context=args.context, overhead_ms=args.overhead_ms,
                           drafted_ms=args.drafted_ms)[0]

    def rate(cost, n):  # tokens per ms of a round of n nodes under ``cost``
        fixed = args.overhead_ms + (args.drafted_ms if n else 0.0)
        return (1 + PROFILE[n]) / (fixed + cost.verify(n, args.context))

    def mean_curve(runs):  # mean plain step + mean difference per size, fitted non-decreasing
        pooled = {n: [p for run in runs for p in run[n]] for n in nodes[1:]}
        plain = statistics.mean(p for n in nodes[1:] for p, _ in pooled[n])
        extra = isotonic([0.0] + [statistics.mean(t - p for p, t in pooled[n]) for n in nodes[1:]])
        return model([plain + max(0.0, e) for e in extra])

    def best_of(ref):
        return max(range(len(PROFILE)), key=lambda n: rate(ref, n))

    refs = [mean_curve(raw[:r] + raw[r + 1:]) for r in range(len(raw))]
    everything = mean_curve(raw)
    ref_extra = [round(everything.verify(s, args.context) - everything.verify(0, args.context), 2) for s in SIZES]
    print(f"\n{cpu}, {threads} threads, {str(dtype).replace('torch.', '')}, context "
          f"{args.context}; mean of all {args.runs} x {args.reps} pairs a size: plain "
          f"{everything.verify(0, args.context):.2f} ms, extra ms at n = {', '.join(map(str, SIZES))}: {ref_extra}; "
          f"best n = {best_of(everything)}; best n of each run's reference (the other runs): "
          f"{[best_of(ref) for ref in refs]}")
    print("| fit | pairs a size | extra ms at n = 4 / 8 / 16: mean (max - min) | chosen n | mean loss | worst loss |")
    print("|---|---|---|---|---|---|")
    table = []
    for group in groups:
        for name, fn in fits.items():
            picks, losses, extras = [], [], {s: [] for s in (4, 8, 16)}
            for r, run in enumerate(raw):
                for g in range(args.reps // group):
                    cost = model(fn(nodes, {n: v[g * group:(g + 1) * group] for n, v in run.items()}))
                    n = chosen(cost)
                    picks.append(n)
                    losses.append(1 - rate(refs[r], n) / rate(refs[r], best_of(refs[r])))
                    for s in extras:
                        extras[s].append(cost.verify(s, args.context) - cost.verify(0, args.context))
            cells = " / ".join(f"{statistics.mean(v):.2f} ({max(v) - min(v):.2f})" for v in extras.values())
            print(f"| {name} | {group} | {cells} | {', '.join(map(str, picks))} | {statistics.mean(losses):.1%} | "
                  f"{max(losses):.1%} |")
            table.append({"fit": name, "pairs": group, "chosen": picks, "mean_loss": statistics.mean(losses),
                          "worst_loss": max(losses), "extra_ms": extras})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "threads": threads, "dtype": str(dtype),
                       "context": args.context, "reps": args.reps, "profile": PROFILE, "drafted_ms": args.drafted_ms,
                       "overhead_ms": args.overhead_ms, "mean_extra_ms": ref_extra,
                       "reference_best": [best_of(ref) for ref in refs],
                       "table": table, "pairs": [{str(n): v for n, v in run.items()} for run in raw]}, f, indent=1)


if __name__ == "__main__":
    main()
