"""Copy a trained drafter into the package (bfloat16 weights, so it stays well under 25 MB), with
a draft vocabulary: the most frequent tokens of the target's responses in the training data.

    python bench/build/ship_drafter.py runs/smollm2_vat/drafter dartree_ext/drafters/smollm2-135m-vat \\
        --responses runs/smollm2_vat/data.jsonl --draft-vocab 4096

Without --responses the drafter's own draft_vocab.json is copied: the way to ship a drafter
trained over its draft vocabulary (dartree-train --draft-vocab N). Block and EAGLE-3 drafters
alike (whichever config file the source holds is copied).
"""
from __future__ import annotations

import argparse
import json
import os

from safetensors.torch import load_file, save_file

from dartree_ext.models import frequent_tokens
from dartree_ext.models.drafter import CONFIG_NAME
from dartree_ext.models.eagle3 import EAGLE3_CONFIG_NAME

SPECIAL = (0, 1, 2)  # SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>: always draftable


def main(argv=None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--responses", default=None, help="JSON lines with 'response' token ids (the training data)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size (with --responses)")
    args = p.parse_args(argv)
    os.makedirs(args.dst, exist_ok=True)
    state = load_file(os.path.join(args.src, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()},
              os.path.join(args.dst, "model.safetensors"))
    names = [n for n in (CONFIG_NAME, EAGLE3_CONFIG_NAME) if os.path.isfile(os.path.join(args.src, n))]
    if not names:
        raise SystemExit(f"{args.src}: no drafter config ({CONFIG_NAME} or {EAGLE3_CONFIG_NAME})")
    with open(os.path.join(args.src, names[0])) as f:
        config = json.load(f)
    with open(os.path.join(args.dst, names[0]), "w") as f:
        json.dump(config, f, indent=2)
    vocab_path = os.path.join(args.dst, "draft_vocab.json")
    if args.responses:
        with open(args.responses) as f:
            responses = [json.loads(line)["response"] for line in f if line.strip()]
        vocab = frequent_tokens(responses, args.draft_vocab, always=SPECIAL)
        with open(vocab_path, "w") as f:
            json.dump(vocab, f)
        kept = set(vocab)
        total = sum(len(r) for r in responses)
        print(f"draft vocabulary: {len(vocab)} tokens, {sum(t in kept for r in responses for t in r) / total:.4f} "
              f"of the {total} response tokens")
    elif os.path.isfile(os.path.join(args.src, "draft_vocab.json")):
        with open(os.path.join(args.src, "draft_vocab.json")) as f, open(vocab_path, "w") as g:
            g.write(f.read())
    size = os.path.getsize(os.path.join(args.dst, "model.safetensors")) / 2 ** 20
    print(f"{args.dst}: {sum(v.numel() for v in state.values()) / 1e6:.2f}M parameters, {size:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
