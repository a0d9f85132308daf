"""Figures from bench/e2e/e2e.py JSON results (PNG):

* ``acceptance.png``: Pr(L >= t) per method, L = tokens committed per round (DARTree Fig. 5);
* ``nodes_per_depth.png``: mean verified-tree nodes per depth per method (Fig. 7);
* ``sweep_<param>.png``: tau vs W, B or beta from sweep runs (Fig. 4).

    python bench/e2e/plots.py bench/results/e2e_smollm2.json --out docs/figures [--sweeps a.json,b.json]
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def acceptance_curve(hist: dict) -> tuple[list[int], list[float]]:
    counts = {int(k): v for k, v in hist.items()}
    total = sum(counts.values())
    top = max(counts, default=0) + 1   # L = accepted + 1
    ts = list(range(1, top + 1))
    return ts, [sum(v for a, v in counts.items() if a + 1 >= t) / total for t in ts]


def main(argv=None) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("--sweeps", default="", help="comma list of sweep result files")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="docs/figures")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = [r for r in json.load(open(args.results)) if r["temperature"] == args.temperature]

    merged_hist, merged_nodes, rounds = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: defaultdict(float)), \
        defaultdict(int)
    for r in results:
        if r["method"] == "ar":
            continue
        for k, v in r["accept_hist"].items():
            merged_hist[r["method"]][int(k)] += v
        for d, v in r["nodes_per_depth"].items():
            merged_nodes[r["method"]][int(d)] += v * r["rounds"]
        rounds[r["method"]] += r["rounds"]

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, hist in merged_hist.items():
        ts, ps = acceptance_curve(hist)
        ax.plot(ts, ps, marker="o", markersize=3, label=method)
    ax.set_xlabel("t (tokens committed in a round)")
    ax.set_ylabel("Pr(L >= t)")
    ax.set_title(f"Acceptance, all sets, T = {args.temperature:g}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "acceptance.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, per_depth in merged_nodes.items():
        ds = sorted(per_depth)
        ax.plot(ds, [per_depth[d] / rounds[method] for d in ds], marker="o", markersize=3, label=method)
    ax.set_xlabel("depth")
    ax.set_ylabel("mean nodes per verified tree")
    ax.set_title("Verification tree shape")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "nodes_per_depth.png"), dpi=120)

    for path in [s for s in args.sweeps.split(",") if s]:
        rows = [r for r in json.load(open(path)) if r["method"] != "ar" and r["temperature"] == args.temperature]
        varying = [k for k in rows[0]["params"] if len({r["params"][k] for r in rows}) > 1]
        if not varying:
            continue
        name = varying[0]
        series = defaultdict(lambda: defaultdict(list))
        for r in rows:
            series[r["method"].split(":")[0]][r["params"][name]].append(r["tau"])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for method, points in series.items():
            xs = sorted(points)
            ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], marker="o", label=method)
        ax.set_xlabel(name)
        ax.set_ylabel("tau")
        ax.set_title(f"tau vs {name}")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"sweep_{name}.png"), dpi=120)
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
