"""How predictable the target's own answers are from their context: for every position of the
cached SmolLM2 responses, the continuation ContextIndex proposes (latest earlier occurrence of the
longest suffix of up to 4 tokens) and P(token d accepted | token d - 1 accepted) per matched n-gram
length and depth.

    python bench/analysis/lookup_stats.py --num 1500
    python bench/analysis/lookup_stats.py --decode 1     # what the decoder learns at T = 1 (new nodes / agreeing)

``--decode T`` instead decodes prompts 5-10 of each Table 1 set (not the 5 the end-to-end tables
use) with `dartree`, the automatic budget and the shipped drafter (SmolLM2 in bfloat16 with
few_rows_linear) at temperature T, and prints the decoder's own record
(:class:`~dartree_ext.decoding.lookup.LookupStats`): a continuation token that is a new node
(the drafter's tree did not have it) is accepted less often than the cached responses say, as the
drafter's own node was often the right one; this is where ``LookupStats``'s priors per regime
come from.
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
    parser.add_argument("--decode", type=float, default=None, metavar="T",
                        help="print what dartree decoding at temperature T learns instead")
    args = parser.parse_args(argv)
    if args.decode is not None:
        return decode_stats(args.decode)
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


def decode_stats(temperature: float) -> int:
    import torch

    from dartree_ext.data import prompts
    from dartree_ext.decoding import SpeculativeDecoder, left_pad
    from dartree_ext.linear import set_linear
    from dartree_ext.loading import encode_prompt, load_drafter, load_target, shipped_drafter, stop_tokens
    loaded = load_target("smollm2", dtype=torch.bfloat16)
    target, tok = loaded.target, loaded.tokenizer
    set_linear(target, "few_rows")
    dec = SpeculativeDecoder(target, load_drafter(shipped_drafter(loaded.name), target), "dartree", budget="auto")
    stops = stop_tokens(tok, target)
    for name in ("gsm8k", "humaneval", "mtbench"):
        for i, item in enumerate(getattr(prompts, name)()[5:11]):
            ids, mask = left_pad([encode_prompt(tok, item.text)])
            dec.generate(ids, mask, max_new_tokens=64, temperature=temperature, stop_token_ids=stops,
                         generator=torch.Generator().manual_seed(i))
    stats = dec.learned.lookup_stats("greedy" if temperature == 0 else "sample")
    print(f"T = {temperature}: P(accepted | previous accepted) by matched n-gram length (rows) and depth "
          "(columns), trials in brackets")
    for label, hits, trials in (("new nodes", stats.hits, stats.trials),
                                ("agreeing", stats.agree_hits, stats.agree_trials)):
        print(label)
        for n in range(stats.max_ngram):
            print(f"n={n + 1} " + " ".join(f"{float(h) / max(1.0, float(t)):.2f}({int(t)})"
                                            for h, t in zip(hits[n, :6], trials[n, :6])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
