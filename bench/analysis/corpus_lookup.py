"""Continuations from a corpus of the target's own outputs (`CorpusIndex`): how often they are
accepted, per matched suffix length and depth, and what a lookup costs.

Three measurements, each per anchor (every position of a response, the context being the prompt
and the response before it; the continuation counts as accepted up to its first token that
differs from the response):

* held out (the priors of `LookupStats`' corpus regimes): a corpus over the training responses
  but every ``--holdout-every``-th, scored on those held-out greedy responses ("corpus-greedy") and
  on the target's samples at T = 1 for ``--sample-prompts`` of their prompts ("corpus-sample");
* evaluation: the corpus over every training response, scored on the target's greedy answers to
  ``--num`` prompts of each evaluation set and to the main command's prompt; and for that prompt
  also with every response sharing a ``--overlap``-gram with its answer left out of the corpus.

``--save PATH`` writes the corpus over every response (the shipped ``corpus.npz``).

    python bench/analysis/corpus_lookup.py --save dartree_ext/drafters/smollm2-135m-vat/corpus.npz \\
        --json bench/results/epyc_zen4/corpus_lookup.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.decoding.lookup import CORPUS_MAX_NGRAM, CorpusIndex
from dartree_ext.loading import encode_prompt, load_target, stop_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN_PROMPT = "Write a haiku about trees."  # dartree-generate's default prompt
DEPTHS = 8


class Tally:
    """Per matched length n: anchors, depth-1 hits; pooled over n: trials and hits at depth d >= 2
    given depth d - 1 accepted; and the accepted tokens."""

    def __init__(self) -> None:
        self.first = np.zeros((CORPUS_MAX_NGRAM + 1, 2))
        self.deeper = np.zeros((DEPTHS + 1, 2))
        self.accepted, self.anchors, self.seconds = 0, 0, 0.0

    def add(self, corpus: CorpusIndex, context: list[int], truth: list[int], length: int = DEPTHS) -> None:
        start = time.perf_counter()
        chain, n = corpus.propose(context, length)
        self.seconds += time.perf_counter() - start
        self.anchors += 1
        got = 0
        while got < min(len(chain), len(truth)) and chain[got] == truth[got]:
            got += 1
        self.accepted += got
        if not chain:
            return
        self.first[n] += (1, got >= 1)
        for d in range(2, min(len(chain), got + 1) + 1):  # depth d tried when d - 1 was accepted
            self.deeper[d] += (1, got >= d)

    def summary(self) -> dict:
        return {"anchors": self.anchors, "accepted_per_anchor": round(self.accepted / max(1, self.anchors), 4),
                "proposed": int(self.first[:, 0].sum()),
                "depth1_by_ngram": {n: [int(t), round(h / t, 3)] for n, (t, h) in enumerate(self.first) if t},
                "deeper_by_depth": {d: [int(t), round(h / t, 3)] for d, (t, h) in enumerate(self.deeper) if t},
                "ms_per_lookup": round(1e3 * self.seconds / max(1, self.anchors), 4)}


def score(tally: Tally, corpus: CorpusIndex, prompt: list[int], response: list[int]) -> None:
    for t in range(len(response)):
        tally.add(corpus, prompt + response[:t], response[t:])


def decode(target, tok, stops, prompt: list[int], temperature: float, max_new_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out = SpeculativeDecoder(target, None, "ar").generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                                          temperature=temperature, stop_token_ids=stops, generator=gen)
    n = out.stats.requests[0].new_tokens
    return out.sequences[0, len(prompt):len(prompt) + n].tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--data", default=os.path.join(HERE, "..", "data", "smollm2_responses.jsonl"))
    p.add_argument("--holdout-every", type=int, default=20)
    p.add_argument("--holdout-num", type=int, default=200, help="held-out greedy responses scored")
    p.add_argument("--sample-prompts", type=int, default=24, help="held-out prompts sampled at T = 1")
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--num", type=int, default=10, help="prompts per evaluation set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--overlap", type=int, default=8)
    p.add_argument("--save", default=None, help="write the corpus over every response here (.npz)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with open(args.data) as f:
        records = [json.loads(line) for line in f]
    result = {"data": os.path.relpath(args.data), "responses": len(records)}

    full = CorpusIndex([r["response"] for r in records])
    result["corpus_tokens"] = len(full)
    if args.save:
        full.save(args.save)
        result["saved_bytes"] = os.path.getsize(args.save)
        print(f"corpus: {len(full)} tokens, {full.documents} documents -> {args.save} "
              f"({result['saved_bytes'] / 2 ** 20:.1f} MiB)")

    held = records[::args.holdout_every]
    corpus = CorpusIndex([r["response"] for i, r in enumerate(records) if i % args.holdout_every])
    greedy = Tally()
    for r in held[:args.holdout_num]:
        score(greedy, corpus, r["prompt"], r["response"])
    result["heldout_greedy"] = greedy.summary()
    print("held out, greedy:", json.dumps(result["heldout_greedy"]))

    loaded = load_target(args.target, dtype=torch.float32)
    target, tok = loaded.target, loaded.tokenizer
    stops = stop_tokens(tok, target)
    sampled = Tally()
    for i, r in enumerate(held[:args.sample_prompts]):
        score(sampled, corpus, r["prompt"], decode(target, tok, stops, r["prompt"], 1.0, args.max_new_tokens, i))
    result["heldout_sample"] = sampled.summary()
    print("held out, T = 1:", json.dumps(result["heldout_sample"]))

    from dartree_ext.data import prompts as shipped
    evaluation = {}
    for name in [s for s in args.sets.split(",") if s]:
        tally = Tally()
        for item in getattr(shipped, name)()[:args.num]:
            ids = encode_prompt(tok, item.text)
            score(tally, full, ids, decode(target, tok, stops, ids, 0.0, args.max_new_tokens, 0))
        evaluation[name] = tally.summary()
        print(f"{name}:", json.dumps(evaluation[name]))
    ids = encode_prompt(tok, MAIN_PROMPT)
    answer = decode(target, tok, stops, ids, 0.0, args.max_new_tokens, 0)
    tally = Tally()
    score(tally, full, ids, answer)
    evaluation["main_prompt"] = tally.summary()
    grams = {tuple(answer[i:i + args.overlap]) for i in range(len(answer) - args.overlap + 1)}
    kept = [r["response"] for r in records
            if not any(tuple(r["response"][i:i + args.overlap]) in grams for i in range(len(r["response"]) - args.overlap + 1))]
    tally = Tally()
    score(tally, CorpusIndex(kept), ids, answer)
    evaluation["main_prompt_without_overlap"] = dict(tally.summary(), responses_left_out=len(records) - len(kept))
    for key in ("main_prompt", "main_prompt_without_overlap"):
        print(f"{key}:", json.dumps(evaluation[key]))
    result["evaluation"] = evaluation
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
