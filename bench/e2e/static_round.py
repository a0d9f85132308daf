"""The static-shape round (:class:`dartree_ext.decoding.StaticRound`) eager and under
``torch.compile(fullgraph=True)``, side by side with plain decoding and the decoder's `dartree`,
the target set up as `dartree-generate` sets it up (`--dtype`, `--linear`).

    python bench/e2e/static_round.py                          # the main command's haiku, B = 8
    python bench/e2e/static_round.py --static-budget 4,8,16 --pairs 3 --json out.json
    python bench/e2e/static_round.py --sets gsm8k,humaneval,mtbench --num-prompts 5 --pairs 1

Methods: `ar` and `--method` (the decoder: `--budget`, `--lookup` as `dartree-generate` takes
them), `static ar` (plain decoding on the static cache: :meth:`StaticRound.plain_step`) and
`static B=b` for each --static-budget, with `adaptive=True` too (`static B=b adaptive`: plain
steps while rounds do not pay), each eager and compiled. A static method keeps one
StaticRound (one cache length: the longest prompt + --max-new-tokens + a tree) for every prompt,
so it compiles once; its compile time is reported on its own. Per prompt, every method decodes
once untimed, then --pairs times in turn (`ar` first); a prompt's figure is the median over its
pairs, a set's the mean over its prompts: time per token, the speedup over the pair's `ar` (the
decoder's plain decoding) and over the pair's `static ar` (eager or compiled like the row: the
like-for-like baseline of a compiled round). Greedy (T = 0): every output is compared with
`ar`'s and with its `static ar`'s (in bfloat16 a static cache and a compiled forward round
differently from the decoder's, so a near-tie can flip between them; float32 outputs are equal,
as the tests check). Every method decodes exactly --max-new-tokens tokens here (no stop token). At --temperature
T > 0 (no top-k / top-p) each decode draws from a generator seeded with --seed, and the
outputs are samples: their comparisons say nothing.
"""
from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from dartree_ext.cli import _load_for_generate, build_generate_parser, decoder_for
from dartree_ext.decoding.config import from_args
from dartree_ext.decoding import StaticRound, left_pad
from dartree_ext.decoding.profiling import cpu_bf16_native, device_name
from dartree_ext.loading import encode_prompt


def prompt_texts(args) -> dict[str, list[str]]:
    if not args.sets:
        return {"prompt": [args.prompt]}
    from dartree_ext.data import prompts as shipped
    return {name: [p.text for p in getattr(shipped, name)()][:args.num_prompts] for name in args.sets.split(",")}


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--sets", default="", help="comma-separated shipped prompt sets instead of --prompt")
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per set")
    parser.add_argument("--static-budget", default="8", help="comma-separated B for the static rounds")
    parser.add_argument("--static-width", type=int, default=4, help="W of the static rounds")
    parser.add_argument("--static-k", type=int, default=8, help="K of the static rounds")
    parser.add_argument("--static-depth", type=int, default=6, help="drafted positions of the static rounds")
    parser.add_argument("--no-adaptive", action="store_true", help="no adaptive=True static methods")
    parser.add_argument("--mode", default=None, help="torch.compile mode of the compiled static methods "
                        "(reduce-overhead: CUDA graphs on a GPU)")
    parser.add_argument("--pairs", type=int, default=3, help="timed passes over every method, per prompt")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    args.method = args.method if args.method != "ar" else "dartree"
    torch.manual_seed(args.seed)
    config, target, tok, drafter, dtype, _, corpus = _load_for_generate(args, parser)
    flags, budget = from_args(args), config.budget
    sets = {name: [torch.tensor(encode_prompt(tok, t, chat=not args.no_chat), dtype=torch.int64) for t in texts]
            for name, texts in prompt_texts(args).items()}
    n_new = args.max_new_tokens
    longest = max(p.numel() for ps in sets.values() for p in ps)
    budgets = [int(x) for x in args.static_budget.split(",")]

    def decoder_run(method: str):
        dec = decoder_for(flags, target, drafter, corpus, method)

        def go(prompt):
            ids, mask = left_pad([prompt])
            gen = torch.Generator(device=args.device).manual_seed(args.seed)
            start = time.perf_counter()
            out = dec.generate(ids.to(args.device), mask.to(args.device), max_new_tokens=n_new,
                               temperature=args.temperature, generator=gen)
            return out.sequences[0, ids.shape[1]:], time.perf_counter() - start, out.stats.tau
        return go

    runs = {"ar": decoder_run("ar"), args.method: decoder_run(args.method)}
    for b in [0] + budgets:
        rnd = StaticRound(target, drafter, max_length=longest + n_new + max(b, 1) + 2, budget=max(b, 1),
                          width=args.static_width, K=args.static_k, depth=args.static_depth)
        for adaptive in ((False,) if b == 0 or args.no_adaptive else (False, True)):
            for compiled in (False, True):
                def go(prompt, rnd=rnd, compiled=compiled, plain=b == 0, adaptive=adaptive):
                    gen = torch.Generator(device=args.device).manual_seed(args.seed)
                    start = time.perf_counter()
                    toks, stats = rnd.generate([prompt.to(args.device)], n_new, compile=compiled, plain=plain,
                                               adaptive=adaptive, temperature=args.temperature, generator=gen,
                                               mode=args.mode)
                    return toks[0], time.perf_counter() - start, stats["tau"]
                name = "static ar" if b == 0 else f"static B={b}" + (" adaptive" if adaptive else "")
                runs[name + (" compiled" if compiled else "")] = go

    compile_s, per_set = {}, {}
    for set_name, prompts in sets.items():
        rows = {name: {"ms": [], "speedup": [], "speedup_static": [], "tau": [], "same": [], "same_static": [],
                       "vs_eager": []}
                for name in runs}
        for i, prompt in enumerate(prompts):
            outputs, taus, times = {}, {}, {name: [] for name in runs}
            for name, go in runs.items():  # untimed: warm-up, and the compile
                start = time.perf_counter()
                outputs[name], _, taus[name] = go(prompt)
                if "compiled" in name and name not in compile_s:
                    compile_s[name] = round(time.perf_counter() - start, 1)
            for _ in range(args.pairs):
                for name, go in runs.items():
                    toks, seconds, _ = go(prompt)
                    times[name].append(seconds / max(1, toks.numel()))
            for name in runs:
                static_ar = "static ar compiled" if "compiled" in name else "static ar"
                row = rows[name]
                row["ms"].append(1e3 * statistics.median(times[name]))
                row["speedup"].append(statistics.median([a / m for a, m in zip(times["ar"], times[name])]))
                row["speedup_static"].append(statistics.median(
                    [a / m for a, m in zip(times[static_ar], times[name])]))
                row["tau"].append(taus[name])
                ar = outputs["ar"]
                row["same"].append(bool(torch.equal(outputs[name].cpu(), ar.cpu())))
                row["same_static"].append(bool(torch.equal(outputs[name].cpu(), outputs[static_ar].cpu())))
                if "compiled" in name:
                    eager = name.replace(" compiled", "")
                    row["vs_eager"].append(statistics.median([e / c for e, c in zip(times[eager], times[name])]))
            print(f"{set_name} {i}: " + ", ".join(f"{n} {rows[n]['speedup'][-1]:.2f}x" for n in runs), flush=True)
        per_set[set_name] = {name: {"ms_per_token": round(statistics.mean(r["ms"]), 2),
                                    "speedup_vs_ar": round(statistics.mean(r["speedup"]), 3),
                                    "speedup_vs_static_ar": round(statistics.mean(r["speedup_static"]), 3),
                                    "tau": round(statistics.mean(r["tau"]), 3),
                                    "same_output_as_ar": f"{sum(r['same'])}/{len(r['same'])}",
                                    "same_output_as_static_ar": f"{sum(r['same_static'])}/{len(r['same_static'])}",
                                    **({"compiled_vs_eager": round(statistics.mean(r["vs_eager"]), 3)}
                                       if r["vs_eager"] else {})}
                         for name, r in rows.items()}
    result = {"device": device_name(torch.device(args.device)), "cpu_bf16_native": cpu_bf16_native(),
              "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": str(dtype).replace("torch.", ""), "linear": args.linear, "max_new_tokens": n_new,
              "pairs": args.pairs, "decoder": {"method": args.method, "budget": budget, "lookup": config.lookup},
              "static": {"width": args.static_width, "K": args.static_k, "depth": args.static_depth,
                         "cache_slots": {f"B={b}": longest + n_new + b + 2 for b in budgets}},
              "compile_s": compile_s, "sets": per_set}
    if len(per_set) > 1:
        result["mean"] = {name: {key: round(statistics.mean(s[name][key] for s in per_set.values()), 3)
                                 for key in ("speedup_vs_ar", "speedup_vs_static_ar", "tau")} for name in runs}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
