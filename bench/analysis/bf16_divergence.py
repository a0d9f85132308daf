"""Where bfloat16 speculative decoding departs from plain bfloat16 decoding, and why.

For each prompt: plain greedy decoding (our ``ar`` loop) and a speculative method, both with the
target in bfloat16; at the first token where they differ, the plain step's top-two logit margin
(bfloat16, and the float32 margin of the same two tokens on the same prefix). A margin at the
level of bfloat16 rounding (a few hundredths at these magnitudes) is a near-tie that the two
computation paths round differently, not a logic error. Also reports HF ``generate``'s own
divergences from the ``ar`` loop in bfloat16, for scale.

    python bench/analysis/bf16_divergence.py --sets gsm8k,humaneval,mtbench --num-prompts 5 --max-new-tokens 64 \
        [--linear few_rows] [--attention kernel|sdpa]
"""
from __future__ import annotations

import argparse
import json

import torch

from dartree_ext.decoding import SpeculativeDecoder, left_pad
from dartree_ext.linear import LINEAR_KINDS, set_linear
from dartree_ext.loading import encode_prompt, load_drafter, load_target, shipped_drafter, stop_tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def margins(target, target32, prefix: list[int], ours: int, theirs: int) -> dict:
    ids = torch.tensor([prefix])
    lb = target(ids).logits[0, -1].float()
    l32 = target32(ids).logits[0, -1].float()
    top2 = lb.topk(2).values
    return {"bf16_top2_margin": round(float(top2[0] - top2[1]), 4),
            "bf16_plain_minus_spec": round(float(lb[theirs] - lb[ours]), 4),
            "fp32_plain_minus_spec": round(float(l32[theirs] - l32[ours]), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--method", default="dartree")
    p.add_argument("--linear", default="torch", choices=list(LINEAR_KINDS),
                   help="the bfloat16 target's linear layers (dartree-generate --linear); HF generate runs the same "
                        "target")
    p.add_argument("--attention", default="kernel", choices=["kernel", "sdpa"],
                   help="few-row attention: the row-invariant CPU kernel (ops.few_rows_attention) or SDPA")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from dartree_ext import attention
    attention.USE_FEW_ROWS_KERNEL = args.attention == "kernel"
    from dartree_ext.data import prompts as shipped
    loaded = load_target("smollm2", dtype=torch.bfloat16)
    target, tok = loaded.target, loaded.tokenizer
    set_linear(target, args.linear)
    target32 = load_target("smollm2", dtype=torch.float32).target
    drafter = load_drafter(shipped_drafter(loaded.name), target)
    stops = stop_tokens(tok, target)
    ar = SpeculativeDecoder(target, None, "ar")
    spec = SpeculativeDecoder(target, drafter, args.method, budget="auto")
    rows, tokens, flips, hf_flips, hf_tokens = [], 0, 0, 0, 0
    for name in args.sets.split(","):
        for prompt in getattr(shipped, name)()[:args.num_prompts]:
            ids = encode_prompt(tok, prompt.text)
            x, m = left_pad([ids])
            plain = ar.generate(x, m, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).sequences[0, len(ids):]
            fast = spec.generate(x, m, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).sequences[0, len(ids):]
            hf = target.generate(x, attention_mask=m, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=stops[0])[0, len(ids):]
            plain, fast, hf = plain.tolist(), fast.tolist(), hf.tolist()
            i = first_difference(plain, fast)
            j = first_difference(plain, hf[:len(plain)])
            tokens += len(plain) if i is None else i + 1
            hf_tokens += len(plain) if j is None else j + 1
            flips += i is not None
            hf_flips += j is not None
            row = {"set": name, "id": prompt.id, "first_divergence": i, "hf_first_divergence": j}
            if i is not None and i < min(len(plain), len(fast)):
                row.update(margins(target, target32, ids + plain[:i], fast[i], plain[i]))
            rows.append(row)
            print(json.dumps(row))
    summary = {"linear": args.linear, "attention": args.attention, "responses": len(rows), "diverged": flips, "tokens_compared": tokens,
               "per_token_rate": round(flips / max(1, tokens), 5), "hf_generate_diverged": hf_flips,
               "hf_per_token_rate": round(hf_flips / max(1, hf_tokens), 5)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
