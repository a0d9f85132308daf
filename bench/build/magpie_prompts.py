"""Self-generated chat prompts (Magpie, Xu et al. 2024): the target is given its chat template up
to the start of a user turn and samples the user's message itself. Each prompt is a request the
model finds typical, so its answers are the model's own typical answers: drafter training data
with no download and no overlap by construction with the evaluation sets (still checked by
:func:`dartree_ext.data.prompts.training_prompts`).

Only messages the model closed with ``<|im_end|>`` are kept, 20 to 1000 characters long,
de-duplicated after normalisation. Appends to ``--out`` batch by batch, so a killed run resumes.

    python bench/build/magpie_prompts.py --num 6000 --out dartree_ext/data/magpie_smollm2.jsonl
    python bench/build/magpie_prompts.py --num 1500 --out dartree_ext/data/magpie_code_smollm2.jsonl --seed 1 \
        --source magpie-code --system "You are a Python programming assistant. Users ask you to write Python functions."
    python bench/build/magpie_prompts.py --num 1500 --out dartree_ext/data/magpie_math_smollm2.jsonl --seed 2 \
        --source magpie-math --system "You are a math tutor. Users ask you grade-school math word problems."
    python bench/build/magpie_prompts.py --num 1500 --out dartree_ext/data/magpie_writing_smollm2.jsonl --seed 3 \
        --source magpie-writing --system "You are a creative writing assistant. Users ask you for short poems, \
haiku, stories, letters and other short pieces of writing."
    python bench/build/magpie_prompts.py --num 500 --out dartree_ext/data/magpie_explain_smollm2.jsonl --seed 4 \
        --source magpie-explain --system "You are a knowledgeable assistant. Users ask you to explain topics in \
science, history, everyday life and how things work."
    python bench/build/magpie_prompts.py --num 1000 --out dartree_ext/data/magpie_roleplay_smollm2.jsonl --seed 5 \
        --source magpie-roleplay --system "You are a role-playing partner. Users ask you to play a character, answer \
in a persona, or act out a scene."
    python bench/build/magpie_prompts.py --num 1000 --out dartree_ext/data/magpie_extract_smollm2.jsonl --seed 6 \
        --source magpie-extract --system "You are a data assistant. Users give you a short text and ask you to \
extract, summarize, list or reformat the information in it."
    python bench/build/magpie_prompts.py --num 1000 --out dartree_ext/data/magpie_reason_smollm2.jsonl --seed 7 \
        --source magpie-reason --system "You are a careful thinker. Users ask you logic puzzles, riddles and \
questions that need step-by-step reasoning."
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dartree_ext.data.prompts import _norm
from dartree_ext.data.smollm2 import load_smollm2, stop_token_ids
from dartree_ext.decoding import SpeculativeDecoder, left_pad


def user_turn_prefix(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to (not including) a user message's text."""
    marker = "\x00MAGPIE\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=6000, help="prompts to keep")
    p.add_argument("--out", default="dartree_ext/data/magpie_smollm2.jsonl")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", default=None,
                   help="a system message that steers the kind of request (default: the template's own)")
    p.add_argument("--source", default="magpie", help="the source name (and id prefix) the prompts get")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    model, tok = load_smollm2(getattr(torch, a.dtype))
    stops = stop_token_ids(tok)
    prefix = user_turn_prefix(tok, a.system)
    kept, seen = [], set()
    if os.path.exists(a.out):
        with open(a.out) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    kept.append(r)
                    seen.add(_norm(r["text"]))
    decoder = SpeculativeDecoder(model, None, "ar")
    batch_no, drawn, t0 = len(kept) // max(1, a.batch // 2), 0, time.time()
    while len(kept) < a.num:
        inp, mask = left_pad([prefix] * a.batch)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + batch_no)
        out = decoder.generate(inp, mask, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                               stop_token_ids=stops, generator=gen)
        new = []
        for b in range(a.batch):
            n = out.stats.requests[b].new_tokens
            ids = out.sequences[b, inp.shape[1]:inp.shape[1] + n].tolist()
            drawn += 1
            if not ids or ids[-1] not in stops:
                continue  # the model did not finish its message
            text = tok.decode(ids[:-1]).strip()
            key = _norm(text)
            if not 20 <= len(text) <= 1000 or not key or key in seen:
                continue
            seen.add(key)
            new.append({"id": f"{a.source}-{len(kept) + len(new)}", "text": text, "source": a.source})
        with open(a.out, "a") as f:
            for r in new[:a.num - len(kept)]:
                f.write(json.dumps(r) + "\n")
        kept += new[:a.num - len(kept)]
        batch_no += 1
        print(f"{len(kept)}/{a.num} prompts kept ({drawn} drawn this run, {time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
