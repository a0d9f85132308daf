"""The target's KV cache growing in place (``decoding.hf.new_cache``, what the loop uses) against a
transformers ``DynamicCache`` (``torch.cat`` of every layer's cache at every step), side by side in
one process: time per token of plain decoding and ``dartree`` (the shipped drafter) on
SmolLM2-135M over HumanEval prompts of about each length (its GGUF blocks,
float32, as the main command's ``auto`` picks on AMX Xeons), the same output asserted, and the
cache's bytes at the end (the growing cache keeps room for a quarter of its length more, at
least 64 slots).

    python bench/e2e/kv_growth.py --prompt-lengths 100 600 --new-tokens 60 --reps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("key_buffer", "value_buffer") if getattr(layer, "key_buffer", None) is not None else ("keys", "values"):
            t = getattr(layer, name)
            total += t.numel() * t.element_size()
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[100, 600])
    p.add_argument("--new-tokens", type=int, default=60)
    p.add_argument("--methods", nargs="+", default=["ar", "dartree"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache
    from dartree_ext.data.prompts import humaneval
    from dartree_ext.data.smollm2 import chat_ids
    from dartree_ext.decoding import SpeculativeDecoder, phases
    from dartree_ext.decoding.profiling import device_name
    from dartree_ext.linear import set_linear
    from dartree_ext.loading import load_drafter, load_target, shipped_drafter

    loaded = load_target("smollm2", torch.float32)  # as the main command loads it (packed attention)
    target, tokenizer = loaded.target, loaded.tokenizer
    set_linear(target, "gguf")
    drafter = load_drafter(shipped_drafter("SmolLM2-135M-Instruct"), target)
    problems = [p.text for p in humaneval()]
    growing = phases.new_cache
    kinds = {"dynamic": lambda t: DynamicCache(config=t.config), "growing": growing}
    print(f"# {device_name('cpu')}, {args.threads} threads, torch {torch.__version__}")
    for method in args.methods:
        for length in args.prompt_lengths:
            # HumanEval problems, as many as make the prompt at least `length` tokens (one chat turn)
            count = 1
            while len(chat_ids(tokenizer, "\n\n".join(problems[:count]))) < length:
                count += 1
            ids = torch.tensor([chat_ids(tokenizer, "\n\n".join(problems[:count]))])
            dec = SpeculativeDecoder(target, drafter if method != "ar" else None, method)
            times, outputs, sizes = {k: [] for k in kinds}, {}, {}
            for rep in range(args.reps + 1):  # the first pair warms up
                for kind, make in kinds.items():
                    made = []
                    phases.new_cache = lambda t, make=make: made.append(make(t)) or made[-1]
                    start = time.perf_counter()
                    outputs[kind] = dec.generate(ids, max_new_tokens=args.new_tokens).sequences
                    if rep:
                        times[kind].append(time.perf_counter() - start)
                    sizes[kind] = _cache_bytes(made[-1])
            phases.new_cache = growing
            if not torch.equal(outputs["dynamic"], outputs["growing"]):
                raise AssertionError(f"{method}, prompt {length}: the caches gave different outputs")
            ratios = [g / d for g, d in zip(times["growing"], times["dynamic"])]
            row = {"method": method, "prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
                   **{f"{k}_ms_per_token": round(statistics.median(v) / args.new_tokens * 1e3, 2) for k, v in times.items()},
                   "time_ratio_growing_vs_dynamic": round(statistics.median(ratios), 3),
                   "pair_ratios": [round(r, 3) for r in ratios],
                   **{f"{k}_cache_mib": round(v / 2 ** 20, 2) for k, v in sizes.items()}, "same_output": True}
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
