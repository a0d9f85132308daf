"""An EAGLE-3 training step with the training-time test run at the sampled roots only
(``Eagle3Drafter.unroll_blocks``, what ``dartree-train --drafter eagle3`` runs) against the same
step with every step at every index (``forward`` then ``block_hidden``), on the same batches.

Per variant: the objective's forward and backward in ms (the target's pass is done once per batch,
outside the timing, as with cached features), alternating the variants batch by batch so the
machine's drift touches both, and the bytes autograd saves for the backward (the activation
memory a step holds). Also checks that both give the same loss and gradients (up to bf16
rounding under autocast).

    python bench/analysis/eagle3_step_time.py                       # SmolLM2-135M, shipped EAGLE-3 drafter
    python bench/analysis/eagle3_step_time.py --target tiny --batches 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from dartree_ext.loading import load_target  # noqa: E402
from dartree_ext.models import Eagle3Drafter  # noqa: E402
from dartree_ext.training import BlockSampler, TrainConfig  # noqa: E402
from dartree_ext.training.eagle import Eagle3Objective, block_hidden  # noqa: E402
from dartree_ext.training.trainer import target_pass  # noqa: E402


def saved_bytes(fn) -> tuple[object, int]:
    """``fn()`` and the bytes of the tensors autograd saved while it ran."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "dartree_ext", "drafters",
                                                      "smollm2-135m-eagle3-vat"),
                   help="an EAGLE-3 drafter directory (a missing one: a fresh drafter for the target)")
    p.add_argument("--data", default=os.path.join(HERE, "..", "data", "smollm2_responses.jsonl"))
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--blocks-per-sequence", type=int, default=16)
    p.add_argument("--loss", default="vat", choices=["vat", "eagle3"])
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast, as training")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)

    loaded = load_target(args.target, dtype=torch.bfloat16 if args.target == "smollm2" else torch.float32)
    target = loaded.target.eval()
    if os.path.isdir(args.drafter) and args.target == "smollm2":
        drafter = Eagle3Drafter.from_pretrained(args.drafter, target)
    else:
        drafter = Eagle3Drafter.from_target(target)
    drafter = drafter.float().train()
    drafter.set_draft_vocab(None)
    if args.target == "smollm2":
        with open(args.data) as f:
            records = [json.loads(line) for _, line in zip(range(args.batches * args.batch_size), f)]
    else:
        gen = torch.Generator().manual_seed(0)
        records = [{"id": str(i), "prompt": torch.randint(0, 97, (12,), generator=gen).tolist(),
                    "response": torch.randint(0, 97, (48,), generator=gen).tolist()}
                   for i in range(args.batches * args.batch_size)]
    sampler = BlockSampler(records, drafter.config.block_size, args.batch_size, args.blocks_per_sequence,
                           max_length=TrainConfig.max_length, seed=0)
    cfg = TrainConfig(out_dir="unused", loss=args.loss, decay_gamma=7.0 if args.loss == "vat" else 1.0,
                      progress=False)
    objective = Eagle3Objective(drafter, cfg)
    sparse_unroll = drafter.unroll_blocks

    def dense_unroll(features, tokens, roots):
        return block_hidden(drafter(features, tokens), roots)

    variants = {"roots only": sparse_unroll, "every index": dense_unroll}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    times = {name: [] for name in variants}
    memory, losses = {}, {name: [] for name in variants}
    grad_gap = 0.0
    for b in range(args.batches):
        batch = sampler.batch(b)
        with autocast:
            tb = target_pass(target, drafter, batch)
        grads = {}
        order = list(variants) if b % 2 == 0 else list(variants)[::-1]
        for name in order:
            drafter.unroll_blocks = variants[name]
            drafter.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with autocast:
                out, saved = saved_bytes(lambda: objective(batch, tb))
            out["loss"].backward()
            times[name].append((time.perf_counter() - start) * 1e3)
            memory[name] = max(memory.get(name, 0), saved)
            losses[name].append(float(out["loss"].detach()))
            grads[name] = torch.cat([q.grad.flatten().float() for q in drafter.parameters() if q.grad is not None])
        a, c = grads["roots only"], grads["every index"]
        grad_gap = max(grad_gap, float((a - c).norm() / c.norm().clamp(min=1e-30)))
    drafter.unroll_blocks = sparse_unroll
    rows = {}
    for name in variants:
        kept = times[name][1:] or times[name]  # the first batch warms up
        rows[name] = {"median_ms": statistics.median(kept), "mean_ms": statistics.mean(kept),
                      "saved_mib": memory[name] / 2**20, "losses": losses[name]}
        print(f"{name:12s} median {rows[name]['median_ms']:8.1f} ms  mean {rows[name]['mean_ms']:8.1f} ms  "
              f"saved for backward {rows[name]['saved_mib']:8.1f} MiB")
    pairs = [d / s for s, d in zip(times["roots only"][1:], times["every index"][1:])] or [float("nan")]
    loss_gap = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(losses["roots only"], losses["every index"]))
    summary = {"target": args.target, "device": "cpu", "threads": torch.get_num_threads(), "bf16": args.bf16,
               "batch_size": args.batch_size, "blocks_per_sequence": args.blocks_per_sequence,
               "steps": drafter.config.num_steps, "variants": rows,
               "speedup_pairs": pairs, "speedup_median": statistics.median(pairs),
               "max_relative_loss_gap": loss_gap, "max_relative_grad_gap": grad_gap}
    print(f"every index / roots only, per batch: {', '.join(f'{x:.2f}' for x in pairs)} "
          f"(median {summary['speedup_median']:.2f}x); loss gap {loss_gap:.2e}, gradient gap {grad_gap:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
