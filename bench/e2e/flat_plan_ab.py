"""The flat forward's direct plan (row and block ops called directly, sibling block layers in one
call) against its plan of module forwards (each layer's own forward, as autograd and wide prefills
run it), or with ``--without stack`` against the same plan with its layers after the first called
from Python instead of from the C++ loop (``_C.DecoderStack``): the same bits (checked), and the
time of one forward over n new tokens.

    python bench/e2e/flat_plan_ab.py --setups float32+gguf,bfloat16+amx --rows 1,9 --rounds 3
    python bench/e2e/flat_plan_ab.py --without stack --setups float32+gguf,float32+gguf_int8

A cache of --context tokens (a fresh one each repetition), the median of --reps after two warm-ups,
both ways in turn each round; ``without / with`` above 1: the plan is faster.
"""
from __future__ import annotations

import argparse
import copy

import torch

from dartree_ext import flat_forward
from dartree_ext.decoding.hf import additive_mask, new_cache
from dartree_ext.decoding.profiling import device_name
from dartree_ext.linear import set_linear
from dartree_ext.loading import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--setups", default="float32+gguf,float32+gguf_int8,bfloat16+amx,bfloat16+few_rows")
    parser.add_argument("--rows", default="1,9")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--without", choices=("plan", "stack"), default="plan",
                        help="what the other side lacks: the direct plan, or its C++ layer loop")
    args = parser.parse_args(argv)
    import time
    base = load_target(args.target, dtype=torch.float32).target
    planned = flat_forward._plan

    stackless = {}

    def generic(model, direct):
        if args.without == "plan":
            return planned(model, False)
        plan = planned(model, direct)
        if plan.stack is None:
            return plan
        if stackless.get(id(plan), (None,))[0] is not plan:
            bare = flat_forward._Plan()
            for name in flat_forward._Plan.__slots__[:-1]:
                setattr(bare, name, getattr(plan, name))
            bare.stack = None
            stackless[id(plan)] = (plan, bare)
        return stackless[id(plan)][1]

    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads, context {args.context}, "
          f"without: the {args.without}")
    print(f"| set-up | rows | with {args.without} ms | without ms | without / with | same bits |")
    print("|---|---|---|---|---|---|")
    for setup in args.setups.split(","):
        dtype_name, kind = setup.split("+")
        dtype = getattr(torch, dtype_name)
        model = copy.deepcopy(base).to(dtype)
        try:
            set_linear(model, kind)
        except (ValueError, RuntimeError) as err:
            print(f"skipping {setup}: {err}")
            continue
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ctx = torch.randint(0, vocab, (1, args.context), generator=gen)
        for n in (int(r) for r in args.rows.split(",")):
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            visible = torch.ones(1, 1, n, args.context + n, dtype=torch.bool)
            visible[..., args.context:] = torch.ones(n, n, dtype=torch.bool).tril()
            mask, pos = additive_mask(visible, dtype), torch.arange(args.context, args.context + n)[None]

            def fresh():
                cache = new_cache(model)
                model(input_ids=ctx, use_cache=True, logits_to_keep=1, past_key_values=cache)
                return cache

            def step(cache):
                return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             past_key_values=cache, output_hidden_states=True)

            times = {True: [], False: []}
            same = True
            with torch.inference_mode():
                try:
                    flat_forward._plan = generic
                    ref = step(fresh())
                    flat_forward._plan = planned
                    out = step(fresh())
                    same = torch.equal(ref.logits, out.logits) and all(
                        torch.equal(a, b) for a, b in zip(ref.hidden_states, out.hidden_states))
                    for _ in range(args.rounds):
                        for use in (True, False):
                            flat_forward._plan = planned if use else generic
                            caches = [fresh() for _ in range(args.reps + 2)]
                            step(caches[0])
                            step(caches[1])
                            ts = []
                            for cache in caches[2:]:
                                t = time.perf_counter()
                                step(cache)
                                ts.append((time.perf_counter() - t) * 1e3)
                            times[use].append(sorted(ts)[len(ts) // 2])
                finally:
                    flat_forward._plan = planned
            w, wo = sorted(times[True])[len(times[True]) // 2], sorted(times[False])[len(times[False]) // 2]
            print(f"| {setup} | {n} | {w:.2f} | {wo:.2f} | {wo / w:.3f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
