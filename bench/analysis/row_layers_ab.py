"""The target's RMSNorms, rotary embedding and SwiGLU through the per-row CPU ops
(``dartree_ext.row_layers``, what ``--linear few_rows`` runs) against transformers' own code, in
one process: for each repetition, plain decoding and ``dartree`` decode the same prompts with the
row layers on, then off (the order alternating), so the machine's drift hits both variants.
Prints each variant's time per token (median over repetitions) for ``ar`` and the method, the
paired ratio off / on, and the method's speedup over ``ar`` in each variant.

    python bench/analysis/row_layers_ab.py --repeats 4                 # the haiku and one prompt of each Table 1 set
    python bench/analysis/row_layers_ab.py --repeats 4 --temperature 1
    python bench/analysis/row_layers_ab.py --forward-rows 1,8,16 --repeats 15   # the target's forward alone

``--forward-rows`` times only the target's forward over n new tokens (a binary tree after a
200-token cache, ``bench/analysis/forward_speed.py``'s tree_forward_ms), the variants alternating.

Both variants use the cost model measured with the row layers on (the decoder's default set-up).
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from dartree_ext.cli import _load_for_generate, build_generate_parser, decoder_for
from dartree_ext.decoding.config import from_args
from dartree_ext.data.prompts import eval_prompts
from dartree_ext.decoding import left_pad
from dartree_ext.loading import encode_prompt, stop_tokens
from dartree_ext.row_layers import restore_row_layers, use_row_layers


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--sets", default="gsm8k,humaneval,mtbench", help="one prompt of each ('' for the haiku only)")
    parser.add_argument("--json", default=None, help="write the per-repetition times here")
    parser.add_argument("--forward-rows", default="", help="time the target's forward alone at these row counts")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    config, target, tok, drafter, _, _, corpus = _load_for_generate(args, parser)
    flags = from_args(args)
    if args.forward_rows:
        return forward_ab(target, [int(n) for n in args.forward_rows.split(",")], args.repeats)
    texts = [args.prompt] + [eval_prompts()[s][0].text for s in args.sets.split(",") if s]
    stops = stop_tokens(tok, target)
    prompts = [left_pad([encode_prompt(tok, t, chat=not args.no_chat)]) for t in texts]

    def decode(method: str) -> tuple[float, int]:
        seconds, tokens = 0.0, 0
        for ids, mask in prompts:
            dec = decoder_for(flags, target, drafter, corpus, method)
            gen = torch.Generator().manual_seed(args.seed)
            start = time.perf_counter()
            out = dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               stop_token_ids=stops, generator=gen)
            seconds += time.perf_counter() - start
            tokens += out.stats.new_tokens
        return seconds, tokens

    variants = {"on": use_row_layers, "off": restore_row_layers}
    for switch in variants.values():  # one untimed decode each (first-call costs)
        switch(target)
        decode("ar")
        decode(args.method)
    times = {(v, m): [] for v in variants for m in ("ar", args.method)}
    for rep in range(args.repeats):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for v in order:
            variants[v](target)
            for m in ("ar", args.method):
                seconds, tokens = decode(m)
                times[(v, m)].append(1e3 * seconds / max(1, tokens))
    use_row_layers(target)
    print(f"{len(texts)} prompts, T = {args.temperature}, {args.repeats} repetitions; ms per token (median)")
    for m in ("ar", args.method):
        on, off = times[("on", m)], times[("off", m)]
        ratios = [b / a for a, b in zip(on, off)]
        print(f"  {m:10s} row layers on {statistics.median(on):6.2f}  off {statistics.median(off):6.2f}  "
              f"off / on {statistics.median(ratios):.3f} (pairs {[round(r, 3) for r in ratios]})")
    for v in variants:
        sp = [a / b for a, b in zip(times[(v, "ar")], times[(v, args.method)])]
        print(f"  {args.method} over ar, row layers {v}: {statistics.median(sp):.3f}x (each {[round(x, 3) for x in sp]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": texts, "temperature": args.temperature, "method": args.method,
                       "ms_per_token": {f"{v}/{m}": t for (v, m), t in times.items()}}, f, indent=1)


def forward_ab(target, rows: list[int], repeats: int) -> None:
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from forward_speed import tree_forward_ms
    times = {(v, n): [] for v in ("on", "off") for n in rows}
    for rep in range(repeats):
        for v in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            (use_row_layers if v == "on" else restore_row_layers)(target)
            for n in rows:
                times[(v, n)].append(tree_forward_ms(target, n, 200))
    use_row_layers(target)
    print(f"target forward after a 200-token cache, ms (median of {repeats}), row layers on / off:")
    for n in rows:
        on, off = times[("on", n)], times[("off", n)]
        print(f"  {n:3d} rows: on {statistics.median(on):6.2f}  off {statistics.median(off):6.2f}  "
              f"off / on {statistics.median([b / a for a, b in zip(on, off)]):.3f}")


if __name__ == "__main__":
    main()
