"""``dartree-train``: generate (or resume) the target's responses to a prompt set, then train a
drafter with the VAT loss (or a baseline). Runs on one process, or on N with
``torchrun --nproc_per_node N -m dartree_ext.training.cli ...`` (or the ``dartree-train``
script under torchrun): DDP, gloo on CPU, nccl on GPU; rank 0 generates the data and writes
checkpoints. A killed run continues where it stopped when started again with the same --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

import torch

from ..loading import encode_prompt, load_target, stop_tokens
from ..models import BlockDrafter, Eagle3Drafter
from ..models.eagle3 import EAGLE3_DECAY_GAMMA
from ..vat import RULES, SCHEDULES
from .data import BlockSampler, generate_responses
from .trainer import CheckpointError, TrainConfig, Trainer, setup_distributed

log = logging.getLogger(__name__)

BUILTIN_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain recursion to a child.",
    "What is the capital of France, and why is it famous?",
    "Give me three tips for writing clean code.",
    "Describe the water cycle.",
    "Write a Python function that reverses a string.",
    "Why do leaves change colour in autumn?",
    "Summarise the rules of chess in a paragraph.",
    "How does a binary search work?",
    "Write a limerick about a cat.",
    "What are prime numbers? Give examples.",
    "Explain what a neural network is.",
    "List five fruits and their colours.",
    "How do I boil an egg?",
    "What causes the seasons on Earth?",
    "Write a haiku about the sea.",
]


def read_prompts(path: str | None) -> list[str]:
    if not path:
        return BUILTIN_PROMPTS
    if path == "shipped":  # the packages' data disjoint from GSM8K / HumanEval / MT-Bench (dartree_ext.data)
        from ..data.prompts import training_prompts
        return [p.text for p in training_prompts(max_chars=1200)]
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["prompt"] for line in f if line.strip()]
        return [line.rstrip("\n") for line in f if line.strip()]


TRAIN_FLAG_HELP = {
    "steps": "optimizer steps in all (a rerun with more continues)",
    "batch_size": "sequences per global step",
    "blocks_per_sequence": "draft blocks (random anchors) per sequence",
    "max_length": "tokens kept per sequence (prompt + response)",
    "lr": "peak learning rate (linear warm-up, then cosine decay)",
    "weight_decay": "AdamW weight decay (matrices only)",
    "warmup_steps": "linear warm-up steps",
    "min_lr_ratio": "the cosine decay's floor as a fraction of --lr",
    "grad_clip": "gradient-norm clip",
    "loss": "vat, a baseline schedule, or eagle3 (EAGLE-3's loss, EAGLE-3 drafters)",
    "rule": "the simulated verification's acceptance rule",
    "decay_gamma": "the VAT decay after the first rejection (block drafters 7, EAGLE-3 drafters 1 / ln 1.25)",
    "vh_weight": "weight of the verification head's loss",
    "accept_width": "the simulated verification's tree width (greedy rule): a position is accepted while the "
                    "target's token is among the drafter's top N (1: a chain)",
    "head_weight": "weight of the correction head's VAT loss (0: the head does not train)",
    "draft_vocab": "> 0: train (and draft) over the N most frequent response tokens; saved with the drafter",
    "bf16": "bf16 autocast on the CPU (always on a GPU)",
    "checkpoint_every": "steps between checkpoints (OUT/checkpoint.pt, OUT/drafter/)",
    "log_every": "steps between lines of OUT/train_log.jsonl",
    "seed": "the seed of the data order, anchors and a new drafter's weights",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``dartree-train`` (every :class:`TrainConfig` field is a flag)."""
    p = argparse.ArgumentParser(prog="dartree-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="tiny", help="'tiny' or a local HF model directory")
    p.add_argument("--prompts", default=None, help="prompts file (.txt one per line, or .jsonl with 'prompt'), or 'shipped' (the "
                   "installed packages' prompts disjoint from the evaluation sets, at most 1200 characters)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--data", default=None, help="response cache (JSON lines); default OUT/data.jsonl")
    p.add_argument("--out", required=True, help="output directory (checkpoint, log, drafter/)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response length when generating data")
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--data-only", action="store_true", help="stop after generating the response cache")
    p.add_argument("--cache-features", action="store_true",
                   help="compute the target's hidden states once (features/ next to the data cache) instead "
                        "of at every step")
    p.add_argument("--init", default=None, help="start from this drafter directory instead of a fresh one")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the drafter's layers as copies of the target's last layers (llama-style targets)")
    p.add_argument("--drafter", default="block", choices=["block", "eagle3"],
                   help="block: the block-parallel drafter (default); eagle3: the autoregressive EAGLE-3 drafter, "
                        "trained by the training-time test (--loss eagle3 for EAGLE-3's loss, or a VAT schedule)")
    p.add_argument("--draft-steps", type=int, default=7, help="eagle3: tokens drafted per round (the unroll depth K)")
    p.add_argument("--target-layers", default=None, metavar="I,J,K",
                   help="the target hidden_states the drafter reads (default: the drafter's own choice); runs on the "
                        "same data and layers share the --cache-features cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--head-state", type=int, default=128)
    p.add_argument("--head-proj", type=int, default=64)
    p.add_argument("--root-in-masks", action="store_true",
                   help="new drafters: add the root token's embedding to every mask position's input")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target weights")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out_dir", "progress"):
            continue
        flag = "--" + f.name.replace("_", "-")
        text = TRAIN_FLAG_HELP.get(f.name)
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=f.default, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            choices = {"loss": [*SCHEDULES, "eagle3"], "rule": list(RULES)}.get(f.name)
            shown = "" if f.name == "decay_gamma" else f" (default {f.default})"
            p.add_argument(flag, type=kind, default=f.default, choices=choices,
                           help=None if text is None else text + shown)
    p.set_defaults(decay_gamma=None)  # resolved below: the drafter's base schedule
    return p


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The arguments, checked, and the new drafter's layer ids (``{}`` for its own choice)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.decay_gamma is None:
        args.decay_gamma = EAGLE3_DECAY_GAMMA if args.drafter == "eagle3" else TrainConfig.decay_gamma
    if args.drafter == "eagle3" and (args.init_from_target or args.root_in_masks or args.draft_vocab):
        p.error("--init-from-target, --root-in-masks and --draft-vocab are block-drafter options")
    if args.accept_width < 1 or (args.accept_width > 1 and args.rule != "greedy"):
        p.error("--accept-width must be >= 1, and > 1 (tree acceptance) only with --rule greedy")
    if args.drafter == "block" and args.loss == "eagle3":
        p.error("--loss eagle3 trains an EAGLE-3 drafter: add --drafter eagle3")
    layer_kw = {}
    if args.target_layers:
        if args.init:
            p.error("--target-layers sets a new drafter's inputs; --init keeps the drafter's own")
        try:
            layer_kw["target_layer_ids"] = tuple(int(v) for v in args.target_layers.split(","))
        except ValueError:
            p.error(f"--target-layers must be comma-separated integers, got {args.target_layers!r}")
    return args, layer_kw


def _responses(args, target, tok, rank: int, world: int) -> tuple[list[dict], str]:
    """The response cache (rank 0 generates what is missing; the others read it) and its path."""
    texts = read_prompts(args.prompts)[:args.num_prompts]
    prompts = [(f"p{i}", encode_prompt(tok, t, chat=not args.no_chat)) for i, t in enumerate(texts)]
    data_path = args.data or os.path.join(args.out, "data.jsonl")
    if rank == 0:
        records = generate_responses(target, prompts, data_path, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.gen_batch, stop_token_ids=stop_tokens(tok, target))
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        records = generate_responses(target, prompts, data_path, progress=False)  # reads the cache
    return records, data_path


def _drafter(args, target, layer_kw: dict, device):
    """The drafter to train: ``--init``'s, or a new one of ``--drafter``'s kind, in float32."""
    if args.init:
        kind = Eagle3Drafter if args.drafter == "eagle3" else BlockDrafter
        drafter = kind.from_pretrained(args.init, target, dtype=torch.float32)
    elif args.drafter == "eagle3":
        torch.manual_seed(args.seed)
        drafter = Eagle3Drafter.from_target(target, num_steps=args.draft_steps, **layer_kw)
    else:
        torch.manual_seed(args.seed)
        drafter = BlockDrafter.from_target(target, init_from_target=args.init_from_target, block_size=args.block_size,
                                           num_layers=args.drafter_layers, head_state_size=args.head_state,
                                           head_proj_size=args.head_proj, root_in_masks=args.root_in_masks, **layer_kw)
    return drafter.to(device=device, dtype=torch.float32).train()


def _features(target, drafter, sampler: BlockSampler, data_path: str, rank: int, world: int):
    """``--cache-features``: the target's features of every sequence, from ``features/`` next
    to the data cache (shared by runs on the same data; rank 0 computes what is missing)."""
    from .features import FeatureCache
    feat_dir = os.path.join(os.path.dirname(os.path.abspath(data_path)), "features")
    seqs, layers = [s for s, _ in sampler.seqs], drafter.config.target_layer_ids
    cache = FeatureCache.build(target, layers, seqs, feat_dir) if rank == 0 else None
    if world > 1:
        torch.distributed.barrier()
    # the other ranks read what rank 0 wrote; rank 0 keeps what it built (no second read of the shards)
    return cache if cache is not None else FeatureCache.build(target, layers, seqs, feat_dir, progress=False)


def main(argv: list[str] | None = None) -> int:
    args, layer_kw = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    loaded = load_target(args.target, dtype=getattr(torch, args.dtype), device=str(device))
    target = loaded.target
    records, data_path = _responses(args, target, loaded.tokenizer, rank, world)
    if args.data_only:
        if rank == 0:
            log.info("%d records in %s", len(records), data_path)
        return 0
    drafter = _drafter(args, target, layer_kw, device)
    cfg = TrainConfig(out_dir=args.out, progress=True, **{f.name: getattr(args, f.name)
                                                         for f in dataclasses.fields(TrainConfig)
                                                         if f.name not in ("out_dir", "progress")})
    sampler = BlockSampler(records, drafter.config.block_size, cfg.batch_size, cfg.blocks_per_sequence,
                           cfg.max_length, cfg.seed)
    features = _features(target, drafter, sampler, data_path, rank, world) if args.cache_features else None
    if rank == 0:
        log.info("%d sequences, %d steps per epoch; drafter %.2fM parameters; %d process(es)", len(sampler.seqs),
                 sampler.steps_per_epoch, drafter.num_parameters() / 1e6, world)
    try:
        history = Trainer(target, drafter, sampler, cfg, rank, world, features).train()
    except CheckpointError as error:  # one line naming the file
        raise SystemExit(f"dartree-train: error: {error}") from None
    if rank == 0 and history:
        last = history[-1]
        log.info("done: step %d loss %.4f mean k* %.2f; drafter saved to %s", last["step"], last["loss"],
                 last["mean_k_star"], os.path.join(args.out, "drafter"))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
