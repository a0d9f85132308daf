"""The README's markdown tables, printed from bench/e2e.py summaries (so the README's figures are
the bench's output, not retyped):

    python bench/readme_tables.py bench/results/e2e_smollm2_t0.summary.json
"""
from __future__ import annotations

import json
import sys

NAMES = {"gsm8k": "GSM8K", "humaneval": "HumanEval", "mtbench": "MT-Bench"}


def table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["method"] != "ar"]
    sets = list(rows[0]["tau"])
    head = "| method | " + " | ".join(f"{NAMES.get(s, s)} tau" for s in sets) + " | mean tau | mean speedup vs AR |"
    lines = [head, "|" + "---|" * (len(sets) + 3)]
    for r in rows:
        cells = " | ".join(f"{r['tau'][s]:.3f}" for s in sets)
        lines.append(f"| {r['method']} | {cells} | {r['mean_tau']:.3f} | {r['mean_speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        with open(path) as f:
            print(f"<!-- {path} -->\n{table(json.load(f))}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
