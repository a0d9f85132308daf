"""Where a decoding round's time goes, function by function: the decoder's phases (drafter pass,
tree, verification, commit) and the calls inside them, in ms per round, for `ar` and a method on
the same prompt, the target set up as `dartree-generate` sets it up (`--dtype`, `--linear`).

    python bench/e2e/round_phases.py                                  # the main command's haiku
    python bench/e2e/round_phases.py --mtbench 1 --temperature 1      # MT-Bench question 1, sampled
    python bench/e2e/round_phases.py --ops                            # top-level ATen calls a round, by phase
    python bench/e2e/round_phases.py --pairs 8                        # speedup over ar, 8 alternating pairs
    python bench/e2e/round_phases.py --cold 50                        # the drafter's pass after a target forward
    python bench/e2e/round_phases.py --by-rows                        # the target's forward time by rows verified
    python bench/e2e/round_phases.py --plain-only --pairs 6           # a method's rounds when no tree pays, against ar

The decoder's phases are timed through its public hook (``generate(..., hook=PhaseHook)``:
prefill, draft, tree, verify, commit, retire, and inside them context and lookup); the calls
inside them (the target's and drafter's forwards, the ops, the sizing's steps) are each wrapped
with a timer (a few microseconds per call, included in the figures). Nested calls are counted in
their callers too, so the rows do not add up. The target's
forward includes the prefill (its calls outnumber the rounds by the prefills). Figures are the
sum over --repeats decodes of the prompt, after one untimed decode per method.

--ops counts, with torch.profiler, the ATen calls made directly by each phase (not those inside
the target's or the drafter's forward, which are counted as their own rows) per round of one
decode. --pairs N prints the median and each of N pairs' speedup over `ar` (ar, then the method;
the ratio within a pair survives the machine's drift). --cold N times the drafter's pass (the
first 4 positions, a 120-slot context) right after a one-token target forward and again right
after itself, N times (median): what the target's forward costs the drafter in caches.
"""
from __future__ import annotations

import collections
import functools
import statistics
import time

import torch

import dartree_ext.decoding.phases as phases_module
import dartree_ext.tree as tree_module
import dartree_ext.decoding.trees as trees_module
from dartree_ext.cli import _load_for_generate, _speedup, build_generate_parser, decoder_for
from dartree_ext.decoding.config import from_args
import dartree_ext.decoding.sizing as sizing_module
from dartree_ext.decoding.sizing import AutoBudget
from dartree_ext.decoding import PhaseHook, SpeculativeDecoder, left_pad
from dartree_ext.decoding.profiling import _drop_last
from dartree_ext.loading import encode_prompt, stop_tokens

DECODER_METHODS = ("build_tree",)
SIZING_METHODS = ("predict_round", "observe_round", "choose_tree", "expected_accepted", "calibrate",
                  "calibrate_unverified", "lookup_steps")


def main() -> None:
    parser = build_generate_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--mtbench", type=int, default=None, metavar="I",
                        help="decode MT-Bench question I instead of --prompt")
    parser.add_argument("--ops", action="store_true", help="count the ATen calls of each phase")
    parser.add_argument("--pairs", type=int, default=0, metavar="N", help="N alternating ar / method pairs")
    parser.add_argument("--cold", type=int, default=0, metavar="N", help="the drafter's pass after a target forward")
    parser.add_argument("--plain-only", action="store_true",
                        help="give the method a cost model under which no tree pays: every round a plain step "
                             "(but the probes), what its rounds cost beyond ar's when drafting does not pay")
    parser.add_argument("--by-rows", action="store_true",
                        help="the target's forward time by the number of rows it verifies (median per count)")
    args = parser.parse_args()
    config, target, tok, drafter, dtype, _, corpus = _load_for_generate(args, parser)
    flags = from_args(args)
    text = args.prompt
    if args.mtbench is not None:
        from dartree_ext.data.prompts import mtbench
        text = mtbench()[args.mtbench].text
    ids, mask = left_pad([encode_prompt(tok, text, chat=not args.no_chat)])
    stops = stop_tokens(tok, target)

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    by_rows: dict[int, list[float]] = collections.defaultdict(list)

    def timed(owner, name: str, label: str | None = None) -> None:
        fn, label = getattr(owner, name), label or name

        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                if args.ops:  # a profiler range: print_ops attributes each ATen call to its phase
                    with torch.profiler.record_function("PH:" + label):
                        return fn(*a, **k)
                return fn(*a, **k)
            finally:
                totals[label] += time.perf_counter() - start
                calls[label] += 1
                if label == "target.forward" and "input_ids" in k:
                    by_rows[k["input_ids"].shape[1]].append(time.perf_counter() - start)

        setattr(owner, name, wrapper)

    class Phases(PhaseHook):
        """Each phase's time (and, with --ops, a profiler range named after it)."""

        def __init__(self) -> None:
            self.open: list[tuple[float, object]] = []

        def enter(self, phase: str, batch) -> None:
            rng = torch.profiler.record_function("PH:" + phase) if args.ops else None
            if rng is not None:
                rng.__enter__()
            self.open.append((time.perf_counter(), rng))

        def exit(self, phase: str, batch, result) -> None:
            start, rng = self.open.pop()
            if rng is not None:
                rng.__exit__(None, None, None)
            totals[phase] += time.perf_counter() - start
            calls[phase] += 1

    hook = None if (args.pairs or args.cold) else Phases()

    if not (args.pairs or args.cold):  # those time the calls as they are, with no wrappers
        for name in SIZING_METHODS:
            timed(AutoBudget, name)
        for name in DECODER_METHODS:
            timed(SpeculativeDecoder, name)
        for name in ("prune", "compact_cache_", "target_tokens_from_logits"):
            timed(phases_module, name)
        for name in ("choose_size", "prune"):
            timed(sizing_module, name)
        for name in ("verify_tree", "tree_attention_mask"):
            timed(phases_module.ops, name)
        timed(tree_module.ops, "build_supertree")
        for name in ("supertree_as_tree", "candidates"):
            timed(tree_module, name)
            timed(trees_module, name)  # (the decoder's tree builders hold their own references)
        timed(target, "forward", "target.forward")
        if drafter is not None:
            timed(drafter, "forward", "drafter.forward")
            for name in ("project_context", "context_kv"):
                if hasattr(drafter, name):
                    timed(drafter, name, f"drafter.{name}")

    def decode(method: str):
        extra = {}
        if args.plain_only and method != "ar":  # a node costs 100 plain steps
            from dartree_ext.decoding.cost import CostModel
            extra = dict(budget="auto", cost_model=CostModel.from_curve({0: 20.0, 1: 2000.0, 4096: 4000.0}, draft_ms=50.0))
        dec = decoder_for(flags, target, drafter, corpus, method, **extra)
        gen = torch.Generator().manual_seed(args.seed)
        return dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops, generator=gen, hook=hook)

    if args.cold:  # no decoding: no cost model or warm-up decodes needed
        return print_cold(target, drafter, args.cold)
    methods = ["ar", args.method]
    for method in methods:  # the cost model, and each shape's first call, out of the figures
        decode(method)
    if args.pairs:
        return print_pairs(decode, args.method, args.pairs)
    if args.ops:
        return print_ops(decode, args.method)
    print(f"dtype {str(dtype).replace('torch.', '')}, linear {args.linear}, T = {args.temperature}, "
          f"{args.repeats} decodes each")
    for method in methods:
        totals.clear()
        calls.clear()
        by_rows.clear()
        outs = [decode(method) for _ in range(args.repeats)]
        rounds = sum(o.stats.rounds for o in outs)
        tokens = sum(o.stats.new_tokens for o in outs)
        seconds = sum(o.stats.total_time for o in outs)
        print(f"{method}: {rounds} rounds, {tokens} tokens (tau {tokens / rounds:.3f}), "
              f"{1e3 * seconds / rounds:.2f} ms a round, {1e3 * seconds / tokens:.2f} ms a token")
        for label, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"   {label:28s} {1e3 * secs / rounds:8.3f} ms/round   calls {calls[label]}")
        if args.by_rows:  # (the prefills are the calls with the most rows)
            print("   target forward by rows: " + ", ".join(
                f"{n}: {1e3 * statistics.median(t):.1f} ms x{len(t)}" for n, t in sorted(by_rows.items())))


def print_pairs(decode, method: str, pairs: int) -> None:
    ratios = []
    for _ in range(pairs):
        ar, out = decode("ar"), decode(method)
        ratios.append(_speedup(ar, out))  # as dartree-generate --compare-ar computes it
    print(f"{method} over ar: median {statistics.median(ratios):.3f}x, tau {out.stats.tau:.2f}, pairs "
          f"{[round(r, 3) for r in ratios]}")


@torch.no_grad()
def print_cold(target, drafter, reps: int) -> None:
    from transformers import DynamicCache
    gen = torch.Generator().manual_seed(0)
    slots = 120
    context = torch.randn(1, slots, drafter.config.hidden_size, generator=gen).to(drafter.dtype)
    positions = torch.arange(slots)[None]
    visible = torch.ones(1, slots, dtype=torch.bool)
    kv = drafter.context_kv(context, positions)
    root, root_pos = torch.tensor([42]), torch.tensor([slots])
    cache = DynamicCache(config=target.config)
    vocab = int(target.config.vocab_size)
    target(input_ids=torch.randint(0, vocab, (1, 100), generator=gen), use_cache=True, past_key_values=cache,
           logits_to_keep=1)
    ids = torch.randint(0, vocab, (1, 1), generator=gen)
    times: dict[str, list[float]] = {"target forward": [], "drafter after it": [], "drafter again": []}
    for rep in range(reps + 10):
        t0 = time.perf_counter()
        target(input_ids=ids, use_cache=True, past_key_values=cache)
        t1 = time.perf_counter()
        drafter(root, root_pos, context, positions, visible, context_kv=kv, positions=4)
        t2 = time.perf_counter()
        drafter(root, root_pos, context, positions, visible, context_kv=kv, positions=4)
        t3 = time.perf_counter()
        _drop_last(cache, 1)
        if rep >= 10:  # warm-up
            for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(t)
    print(", ".join(f"{name} {1e3 * statistics.median(t):.3f} ms" for name, t in times.items()) + f" (median of {reps})")


def print_ops(decode, method: str) -> None:
    with torch.profiler.profile() as prof:
        out = decode(method)
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("PH:") or (parent is not None and not parent.name.startswith("PH:")):
            continue  # only calls made directly by a phase (or outside every phase)
        counts[parent.name[3:] if parent is not None else "(outside the phases)"] += 1
    print(f"{method}: top-level ATen calls a round ({out.stats.rounds} rounds); the forwards' own calls are "
          "in their rows")
    for name, count in counts.most_common():
        print(f"   {name:28s} {count / out.stats.rounds:8.1f}")


if __name__ == "__main__":
    main()
