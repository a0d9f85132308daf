"""Measure a drafter's acceptance per tree-score bin on training prompts and save it next to the
drafter (``calibration.json``): ``budget="auto"`` starts from these counts instead of a generic
prior, so a first request sizes its trees well from the first round.

Every method of ``budget="auto"``, greedy (T = 0) and sampling (T = 1); trees of ``--budget``
nodes every round (a cost model in which nodes are free), so every score bin is observed;
prompts from :func:`dartree_ext.data.prompts.training_prompts` (disjoint from the evaluation sets).

    python bench/build/calibrate_drafter.py dartree_ext/drafters/smollm2-135m-vat --num-prompts 12
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dartree_ext.decoding import SpeculativeDecoder, left_pad
from dartree_ext.decoding.calibration import DepthCalibrator
from dartree_ext.decoding.cost import CostModel
from dartree_ext.decoding.decoder import AUTO_METHODS, drafter_fits
from dartree_ext.loading import encode_prompt, load_drafter, load_target, stop_tokens
from dartree_ext.models.drafter import CALIBRATION_NAME


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--width", type=int, default=12, help="the trees' width (EAGLE-3: frontier nodes a step)")
    p.add_argument("--K", type=int, default=64, help="candidates per position (EAGLE-3: children per node, at most W)")
    p.add_argument("--methods", default=None, help="comma-separated; default: every budget='auto' method the "
                   "drafter fits (the block methods, or eagle3 and eagle3_vh for an EAGLE-3 drafter)")
    args = p.parse_args(argv)
    from dartree_ext.data.prompts import training_prompts
    loaded = load_target(args.target, dtype=getattr(torch, args.dtype))
    target, tok = loaded.target, loaded.tokenizer
    drafter = load_drafter(args.drafter, target)
    drafter.calibration = {}  # measure from scratch
    stops = stop_tokens(tok, target)
    pool = training_prompts(max_chars=1200)
    step = max(1, len(pool) // args.num_prompts)
    prompts = [encode_prompt(tok, pr.text) for pr in pool[::step][:args.num_prompts]]
    free = CostModel.from_curve({0: 10.0, 10 ** 6: 10.001})
    out = {}
    methods = args.methods.split(",") if args.methods else [m for m in AUTO_METHODS if m != "lookup"
                                                            and drafter_fits(m, drafter)]
    for method in [m for m in methods if m]:
        for regime, temperature in (("greedy", 0.0), ("sample", 1.0)):
            cal = DepthCalibrator.fresh()
            dec = SpeculativeDecoder(target, drafter, method, budget="auto", max_budget=args.budget, cost_model=free,
                                     calibrator=cal, width=args.width, K=args.K)
            gen = torch.Generator().manual_seed(0)
            for ids in prompts:
                dec.generate(*left_pad([ids]), max_new_tokens=args.max_new_tokens, temperature=temperature,
                             stop_token_ids=stops, generator=gen)
            out[f"{method}@{regime}"] = cal.state_dict()
            rate = cal.hits.sum() / cal.trials.sum().clamp(min=1)
            print(f"{method}@{regime}: {int(cal.trials.sum())} nodes verified, {float(rate):.3f} accepted; "
                  f"per depth class and bin {[[round(float(x), 3) for x in c.probabilities()] for c in cal.classes]}")
    with open(os.path.join(args.drafter, CALIBRATION_NAME), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
