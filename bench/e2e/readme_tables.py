"""The README's results table, printed from a bench/e2e/e2e.py results file (so the README's figures
are the bench's output, not retyped): per set "tau / speedup", then the means over sets.

    python bench/e2e/readme_tables.py bench/results/e2e_smollm2_speed_t0.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

NAMES = {"gsm8k": "GSM8K", "humaneval": "HumanEval", "mtbench": "MT-Bench"}


def table(rows: list[dict]) -> str:
    sets = list(dict.fromkeys(r["set"] for r in rows))
    by_method: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_method[r["method"]][r["set"]] = r
    head = "| method | " + " | ".join(f"{NAMES.get(s, s)} tau / speedup" for s in sets) + " | mean tau | mean speedup |"
    lines = [head, "|" + "---|" * (len(sets) + 3)]
    for method, per_set in by_method.items():
        cells = " | ".join(f"{per_set[s]['tau']:.2f} / {per_set[s]['speedup']:.2f}x" if s in per_set else "-"
                           for s in sets)
        present = [per_set[s] for s in sets if s in per_set]
        mean_tau = sum(r["tau"] for r in present) / len(present)
        mean_speedup = sum(r["speedup"] for r in present) / len(present)
        lines.append(f"| {method} | {cells} | {mean_tau:.3f} | {mean_speedup:.3f}x |")
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
