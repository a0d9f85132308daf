"""Time per token against the memory floor: this machine's read bandwidth, the bytes of weights
each method reads per token, and how far above the floor each runs.

Plain decoding reads every weight of the target once a token, so bytes / bandwidth is its floor;
a speculative round reads them once for the verification (and the drafter's once) and gives tau
tokens. Per set-up of the target (dtype + linear layers, ``--setups``: the GGUF's Q4_1 / Q8_0 blocks
through ``quant_linear`` in float32 and bfloat16, bfloat16 dense through ``few_rows_linear`` and
``amx_linear``, the blocks through ``quant_linear_int8``) it decodes the prompt with ``ar``
and ``dartree`` (the main command's settings), and with ``--llama-cpp`` llama.cpp's plain decoding
of the same GGUF, in turn ``--repeats`` times; times are past the first token (prefill left out),
the median of the repeats.

    python bench/e2e/memory_floor.py --json bench/results/xeon/memory_floor.json --llama-cpp

Bandwidth: the best of 7 ``torch.sum`` passes over a 1 GiB float32 buffer with torch's threads
(what a decode's weight reads look like: long sequential reads of data not in the caches).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

from dartree_ext.cli import build_generate_parser, decoder_for, generate_config, load_corpus_for
from dartree_ext.decoding import left_pad
from dartree_ext.decoding.profiling import device_name
from dartree_ext.linear import linear_kinds, set_linear
from dartree_ext.loading import encode_prompt, load_drafter, load_target, shipped_drafter, stop_tokens
from dartree_ext.quant import gguf_source, layer_blocks

SETUPS = ("float32+gguf", "bfloat16+gguf", "bfloat16+few_rows", "bfloat16+amx", "bfloat16+gguf_int8")


def read_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Bytes per second of the best ``torch.sum`` pass over a ``gib`` GiB float32 buffer."""
    buf = torch.ones(int(gib * 2 ** 30) // 4)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a forward over one token reads of ``model``'s weights: each linear layer's blocks
    (patched with the GGUF's) or dense weight (a tied output head counted once, as the layer it
    is), the other parameters but the input embedding table (one row a token)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            seen.add(module.weight.data_ptr())
            blocks = layer_blocks(module)
            total += blocks[1].numel() if blocks else module.weight.numel() * module.weight.element_size()
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    for param in model.parameters():
        if param.data_ptr() not in seen and (embed is None or param.data_ptr() != embed.data_ptr()):
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def decode_ms(stats) -> float:
    """Time per token past the first (prefill and the token it gives left out)."""
    requests = len(stats.requests)
    return 1e3 * (stats.total_time - stats.time.get("prefill", 0.0)) / max(1, stats.new_tokens - requests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Write a haiku about trees.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's plain decoding of the target's GGUF")
    parser.add_argument("--setups", default=",".join(SETUPS), help="dtype+linear, comma-separated (amx where available)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({device_name('cpu')}, {torch.get_num_threads()} threads)")
    loaded = load_target("smollm2", dtype=torch.float32)
    tok, base = loaded.tokenizer, loaded.target
    ids, mask = left_pad([encode_prompt(tok, args.prompt)])
    stops = stop_tokens(tok, base)
    config = generate_config(build_generate_parser().parse_args(["--max-new-tokens", str(args.max_new_tokens)]))
    drafter_path = shipped_drafter(loaded.name)
    rows = []
    for setup in args.setups.split(","):
        dtype, linear = setup.split("+")
        if linear not in linear_kinds(base):
            print(f"skipping {setup}: linear {linear!r} is not available here")
            continue
        target = copy.deepcopy(base).to(getattr(torch, dtype))
        set_linear(target, linear)
        drafter = load_drafter(drafter_path, target)
        corpus = load_corpus_for(config, drafter_path)
        decoders = {"ar": decoder_for(config, target, None, None, "ar"),
                    "dartree": decoder_for(config, target, drafter, corpus)}
        runs = {name: [] for name in decoders}
        outputs = {}
        for rep in range(args.repeats + 1):  # the first: warm-up (and the cost model, once)
            for name, dec in decoders.items():
                out = dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                if rep:
                    runs[name].append(out.stats)
                outputs[name] = out.sequences
        target_bytes, drafter_bytes = weight_bytes(target), weight_bytes(drafter)
        for name, stats in runs.items():
            ms = statistics.median(decode_ms(s) for s in stats)
            last = stats[-1]
            tau = last.new_tokens / max(1, last.rounds)
            per_token = (target_bytes + (drafter_bytes if name != "ar" else 0)) / tau
            floor = 1e3 * per_token / bandwidth
            rows.append(dict(setup=f"{dtype}+{linear}", method=name, ms_per_token=round(ms, 2), tau=round(tau, 3),
                             mb_per_token=round(per_token / 1e6, 1), floor_ms=round(floor, 2),
                             over_floor=round(ms / floor, 2), same_as_ar=bool(torch.equal(outputs[name], outputs["ar"]))))
        del target, drafter, decoders
    if args.llama_cpp:
        from dartree_ext.llama_cpp import LlamaCppBaseline
        path = gguf_source(base)
        llama = LlamaCppBaseline(path)
        prompt = ids[0].tolist()
        llama.generate(prompt, 2, stops)
        times = [llama.generate(prompt, args.max_new_tokens, stops).decode_ms_per_token for _ in range(args.repeats)]
        size = os.path.getsize(path)
        floor = 1e3 * size / bandwidth
        rows.append(dict(setup="llama.cpp Q4_1", method="ar", ms_per_token=round(statistics.median(times), 2), tau=1.0,
                         mb_per_token=round(size / 1e6, 1), floor_ms=round(floor, 2),
                         over_floor=round(statistics.median(times) / floor, 2), same_as_ar=None))
    print(f"\n{'set-up':18s} {'method':8s} {'ms/token':>9s} {'tau':>6s} {'MB/token':>9s} {'floor ms':>9s} {'x floor':>8s}")
    for r in rows:
        print(f"{r['setup']:18s} {r['method']:8s} {r['ms_per_token']:9.2f} {r['tau']:6.2f} {r['mb_per_token']:9.1f} "
              f"{r['floor_ms']:9.2f} {r['over_floor']:8.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": device_name("cpu"), "threads": torch.get_num_threads(),
                       "read_gb_per_s": round(bandwidth / 1e9, 2), "prompt": args.prompt,
                       "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
