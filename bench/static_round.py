"""The static-shape round (:class:`dartree_ext.decoding.StaticRound`) eager and under
``torch.compile(fullgraph=True)``, side by side with plain decoding and the decoder's `dartree`,
on the same prompt, the target set up as `dartree-generate` sets it up (`--dtype`, `--linear`).

    python bench/static_round.py                          # the main command's haiku, B = 8
    python bench/static_round.py --static-budget 4,8 --pairs 5 --json out.json
    python bench/static_round.py --mtbench 1

Every method decodes the prompt once untimed first (the compiled round compiles there: its
compile time is reported on its own). Then --pairs rounds of: `ar`, the decoder's method
(`--method`, `--budget`), static plain decoding and each static round, eager then compiled; each figure
is the median over pairs of ms per token and the speedup over the pair's `ar` (the decoder's
plain decoding) and over the pair's static plain decoding (`static ar`, eager or compiled like
the row: the like-for-like baseline of a compiled round). Greedy (T = 0):
every output is checked against `ar`'s. The static rounds stop at the token budget (no stop
token), so every method decodes exactly --max-new-tokens tokens here.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dartree_ext.cli import _load_for_generate, build_generate_parser
from dartree_ext.decoding import SpeculativeDecoder, StaticRound, left_pad
from dartree_ext.decoding.cost import cpu_bf16_native, device_name
from dartree_ext.loading import encode_prompt


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--mtbench", type=int, default=None, metavar="I", help="MT-Bench question I instead of --prompt")
    parser.add_argument("--static-budget", default="8", help="comma-separated B for the static rounds")
    parser.add_argument("--static-width", type=int, default=4, help="W of the static rounds")
    parser.add_argument("--static-k", type=int, default=8, help="K of the static rounds")
    parser.add_argument("--static-depth", type=int, default=6, help="drafted positions of the static rounds")
    parser.add_argument("--pairs", type=int, default=3, help="timed passes over every method")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    args.method = args.method if args.method != "ar" else "dartree"
    torch.manual_seed(args.seed)
    target, tok, drafter, dtype, _, budget = _load_for_generate(args)
    text = args.prompt
    if args.mtbench is not None:
        from dartree_ext.data.prompts import mtbench
        text = mtbench()[args.mtbench].text
    prompt = torch.tensor(encode_prompt(tok, text, chat=not args.no_chat), dtype=torch.int64)
    ids, mask = left_pad([prompt])
    n_new = args.max_new_tokens

    def decoder_run(method: str):
        dec = SpeculativeDecoder(target, drafter if method != "ar" else None, method,
                                 budget=budget if method != "ar" else 64, width=args.width, K=args.K,
                                 lookup=args.lookup if method != "ar" else None)

        def go():
            start = time.perf_counter()
            out = dec.generate(ids, mask, max_new_tokens=n_new)
            return out.sequences[0, ids.shape[1]:], time.perf_counter() - start, out.stats.tau
        return go

    runs = {"ar": decoder_run("ar"), args.method: decoder_run(args.method)}
    compile_s = {}
    for b in [0] + [int(x) for x in args.static_budget.split(",")]:
        rnd = StaticRound(target, drafter, max_length=prompt.numel() + n_new + 2 * (max(b, 1) + 1),
                          budget=max(b, 1), width=args.static_width, K=args.static_k, depth=args.static_depth)
        for compiled in (False, True):
            def go(rnd=rnd, compiled=compiled, plain=b == 0):
                start = time.perf_counter()
                toks, stats = rnd.generate([prompt], n_new, compile=compiled, plain=plain)
                return toks[0], time.perf_counter() - start, stats["tau"]
            name = ("static ar" if b == 0 else f"static B={b}") + (" compiled" if compiled else "")
            runs[name] = go
    outputs, times, taus = {}, {name: [] for name in runs}, {}
    for name, go in runs.items():  # untimed: warm-up, and the compile
        start = time.perf_counter()
        outputs[name], _, taus[name] = go()
        if "compiled" in name:
            compile_s[name] = round(time.perf_counter() - start, 1)
    for _ in range(args.pairs):
        for name, go in runs.items():
            toks, seconds, taus[name] = go()
            times[name].append(seconds / max(1, toks.numel()))
    ar = outputs["ar"]
    rows = {}
    for name in runs:
        speed = [a / m for a, m in zip(times["ar"], times[name])]
        static_ar = "static ar compiled" if "compiled" in name else "static ar"
        rows[name] = {"speedup_vs_static_ar": round(statistics.median(
                          [a / m for a, m in zip(times[static_ar], times[name])]), 3),
                      "ms_per_token": round(1e3 * statistics.median(times[name]), 2),
                      "speedup_vs_ar": round(statistics.median(speed), 3),
                      "speedup_pairs": [round(x, 3) for x in speed], "tau": round(taus[name], 3),
                      "same_output_as_ar": bool(torch.equal(outputs[name][:ar.numel()], ar[:outputs[name].numel()]))}
        if name in compile_s:
            rows[name]["compile_s"] = compile_s[name]
            eager = name.replace(" compiled", "")
            rows[name]["compiled_vs_eager"] = round(statistics.median(
                [e / c for e, c in zip(times[eager], times[name])]), 3)
    result = {"device": device_name(torch.device(args.device)), "cpu_bf16_native": cpu_bf16_native(),
              "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": str(dtype).replace("torch.", ""), "linear": args.linear, "prompt_tokens": prompt.numel(),
              "max_new_tokens": n_new, "pairs": args.pairs,
              "static": {"width": args.static_width, "K": args.static_k, "depth": args.static_depth},
              "methods": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
