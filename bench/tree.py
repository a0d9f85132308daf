"""Per-round DARTree construction (supertree + prune) at the paper's shape: ours vs the
pure-PyTorch reference vs the sequential heap (seq_heap), side by side in one run.

    python bench/tree.py                       # both head sizes, batch 1 and 8, CPU (+ CUDA)
    python bench/tree.py --heads 0.1B --batch 1 --device cpu

Shape: D = 16 positions, K = 64 candidates, W = 12 per depth, B = 64 budget, depth bonus -0.2.
Heads (our drafter design): "0.1B" = SmolLM2-135M-sized target (hidden 576, V = 49152) with a
256 x 256 correction head; "4B" = Qwen3-4B-sized (hidden 2560, V = 151936), 512 x 512, bf16.
Times are medians per round, the three cases interleaved call by call (so a drifting machine
slows them alike); memory is the op's workspace + outputs (nothing grows with V: only
the K candidate rows of fc2 and gru_table are read).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import dartree_ext
from dartree_ext import reference
from dartree_ext.head import CorrectionHeadWeights
from dartree_ext.tree import prune, seq_heap, supertree_as_tree
from dartree_ext import ops

HEADS = {
    "0.1B": dict(hidden=576, vocab=49152, e=256, g=256, dtype=torch.float32),
    "4B": dict(hidden=2560, vocab=151936, e=512, g=512, dtype=torch.bfloat16),
}
DEPTH, K, WIDTH, BUDGET, BONUS = 16, 64, 12, 64, -0.2


def timed(fns, device, min_seconds=1.0, max_reps=200, min_reps=3) -> list[float]:
    """Median microseconds per call of each of ``fns``, run in turn (one call of each per
    repetition), so that a machine whose speed drifts slows every case alike and their ratios hold."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    start = time.perf_counter()
    while len(samples[0]) < min_reps or (time.perf_counter() - start < min_seconds and len(samples[0]) < max_reps):
        for fn, out in zip(fns, samples):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    return [statistics.median(s) * 1e6 for s in samples]


def round_inputs(spec, batch, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = CorrectionHeadWeights.random(spec["vocab"], spec["hidden"], spec["e"], spec["g"], dtype=spec["dtype"],
                                    device=device, seed=seed)
    hidden = torch.randn(batch, DEPTH, spec["hidden"], generator=gen).to(device)
    z = head.project(hidden).contiguous()
    cand_ids = torch.stack([torch.randperm(spec["vocab"], generator=gen)[:K] for _ in range(batch * DEPTH)])
    cand_ids = cand_ids.view(batch, DEPTH, K).to(device)
    cand_base = torch.sort(torch.randn(batch, DEPTH, K, generator=gen) * 2, -1, descending=True).values
    cand_base = cand_base.to(device=device, dtype=spec["dtype"])
    root_state = torch.randn(batch, spec["g"], generator=gen).to(device=device, dtype=spec["dtype"])
    roots = torch.zeros(batch, dtype=torch.long, device=device)
    return head, z, cand_ids, cand_base, root_state, roots


def ours(head, z, cand_ids, cand_base, root_state, roots):
    supertree = ops.build_supertree(head, z, cand_ids, cand_base, root_state, WIDTH, BONUS)
    return prune(supertree_as_tree(*supertree, roots), BUDGET)


def pytorch_reference(head, z, cand_ids, cand_base, root_state, roots):
    supertree = reference.build_supertree(head, z, cand_ids, cand_base, root_state, WIDTH, BONUS)
    tree = supertree_as_tree(*supertree, roots)
    keep, new_parents, num_kept = reference.select_top_b(tree.parents, tree.scores, tree.num_nodes, BUDGET)
    return keep, new_parents, num_kept


def workspace_bytes(batch, spec) -> int:
    m = DEPTH * WIDTH
    return (batch * WIDTH * (K + spec["e"] + spec["g"]) * 4 + 2 * batch * WIDTH * spec["g"] * 4  # workspace, states
            + batch * m * (8 + 4 + 4 + 4))  # supertree outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dartree_ext.build_info()["cuda"] else [])
    parser.add_argument("--device", nargs="+", default=default_devices)
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq-heap-batch", type=int, default=1, help="requests timed for seq_heap (per request)")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="time each case at least this long (at least 3 repetitions; the median is reported)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; D={DEPTH} K={K} W={WIDTH} B={BUDGET}")
    print("| head | device | batch | ours (us) | reference (us) | ref / ours | seq_heap (us) | seq_heap / ours "
          "| workspace+outputs (KiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.heads:
        spec = HEADS[name]
        for dev_name in args.device:
            device = torch.device(dev_name)
            for batch in args.batch:
                inputs = round_inputs(spec, batch, device)
                # seq_heap is per request and slow: time `seq_heap_batch` requests, scale to the batch
                n = min(batch, args.seq_heap_batch)
                sub = tuple(t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t
                            for t in inputs)
                t_ours, t_ref, t_seq = timed([lambda: ours(*inputs), lambda: pytorch_reference(*inputs),
                                              lambda: seq_heap(sub[0], *sub[1:4], sub[5], sub[4], BUDGET, BONUS)],
                                             device, min_seconds=args.min_seconds)
                t_seq *= batch / n
                print(f"| {name} | {dev_name} | {batch} | {t_ours:.0f} | {t_ref:.0f} | {t_ref / t_ours:.1f}x | "
                      f"{t_seq:.0f} | {t_seq / t_ours:.1f}x | {workspace_bytes(batch, spec) / 1024:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
