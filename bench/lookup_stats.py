"""How predictable the target's own answers are from their context: for every position of the
cached SmolLM2 responses, the continuation ContextIndex proposes (latest earlier occurrence of the
longest suffix of up to 4 tokens) and P(token d accepted | token d - 1 accepted) per matched n-gram
length and depth.

    python bench/lookup_stats.py --num 1500
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from dartree_ext.decoding.lookup import ContextIndex


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", default="bench/data/smollm2_responses.jsonl")
    parser.add_argument("--num", type=int, default=1500, help="first N responses")
    parser.add_argument("--length", type=int, default=12, help="continuation tokens proposed")
    args = parser.parse_args(argv)
    hits, trials, positions = Counter(), Counter(), 0
    with open(args.responses) as f:
        records = [json.loads(line) for _, line in zip(range(args.num), f)]
    for rec in records:
        response = rec["response"]
        index = ContextIndex(rec["prompt"] + response[:1])
        for t in range(1, len(response)):
            positions += 1
            chain, n = index.propose(args.length)
            for d, token in enumerate(chain):
                if t + d >= len(response):
                    break
                trials[n, d + 1] += 1
                if token != response[t + d]:
                    break
                hits[n, d + 1] += 1
            index.extend(response[t:t + 1])
    print(f"{len(records)} responses, {positions} positions; P(accepted | previous accepted) by matched n-gram "
          f"length (rows) and depth (columns), trials in brackets")
    for n in range(1, 5):
        cells = " ".join(f"{hits[n, d] / max(1, trials[n, d]):.2f}({trials[n, d]})" for d in range(1, args.length + 1))
        print(f"n={n} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
