"""Per-round DARTree construction (supertree + prune) at the paper's shape: ours vs the
pure-PyTorch reference vs the sequential heap (seq_heap), side by side in one run.

    python bench/ops/tree.py                       # both head sizes, batch 1 and 8, CPU (+ CUDA)
    python bench/ops/tree.py --heads 0.1B --batch 1 --device cpu
    python bench/ops/tree.py --gpu-model h200 --json round.json   # modelled GPU time, "4B" head (clang++)

Shape: D = 16 positions, K = 64 candidates, W = 12 per depth, B = 64 budget, depth bonus -0.2.
Heads (our drafter design): "0.1B" = SmolLM2-135M-sized target (hidden 576, V = 49152) with a
256 x 256 correction head; "4B" = Qwen3-4B-sized (hidden 2560, V = 151936), 512 x 512, bf16.
Times are medians per round, the three cases interleaved call by call (so a drifting machine
slows them alike); memory is the op's workspace + outputs (nothing grows with V: only
the K candidate rows of fc2 and gru_table are read).

``--gpu-model`` measures nothing on a GPU: it runs one round's CUDA kernels (build_supertree's
expansion launches and prune's select_top_b) under the instrumented CPU emulator
(python_tests/emulated.py, needs clang++), counts their launches and global-memory bytes, and
turns them into a modelled time, labelled as such: launches x per-launch cost + bytes / HBM
bandwidth (H200: 4.8 TB/s HBM3e; 4 us a launch; --launch-us / --hbm-tbps override them). Every
load and store of the kernels counts (no cache model: re-reads an L2 would serve count at HBM
rate); the torch glue between the ops (supertree_as_tree, prune's gathers) is not counted. --json
writes one record per head and batch. Batch 1 and 8 take about 2 minutes on a 2-core machine
(depths 2 and 3 emulated, extended to D; --full-depth emulates all 16: about 8 minutes, same counts).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import dartree_ext
from dartree_ext import reference
from dartree_ext.head import CorrectionHeadWeights
from dartree_ext.tree import prune, seq_heap, supertree_as_tree
from dartree_ext import ops
from dartree_ext._widths import depth_widths

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


GPU_MODELS = {"h200": dict(name="NVIDIA H200", hbm_tbps=4.8)}  # HBM3e, TB/s


def min_bytes_per_round(spec, batch) -> int:
    """The global-memory bytes one round cannot avoid: every input and every weight row the round
    needs read once per depth, every output written once, intermediates (parent states and
    scores, hidden vectors, candidate scores) kept on chip. Per depth d of D, with W_d children:
    w_s [E, G] whole; per request the depth's z row [E], its K candidate ids (int64) and base
    logits, and the K fc2 rows [K, E] (+ K biases); for every depth but the last (whose children
    are never expanded) w_hh [3G, G] (+ b_hh) and the W_d kept children's gru_table rows [3G]. Once:
    the root states [B, G]; the supertree's outputs [B, M] (int64 tokens, int32 parents and
    depths, float32 scores, M = sum W_d); prune reads parents and scores of the M + 1 nodes and
    the node counts, and writes keep and new_parents [B, budget + 1] (int32) and the kept counts."""
    elem = torch.finfo(spec["dtype"]).bits // 8
    e, g = spec["e"], spec["g"]
    widths = depth_widths(WIDTH, DEPTH, exact=True)
    total = 0
    for d, width in enumerate(widths):
        total += e * g * elem + batch * (e * elem + K * 8 + K * elem + K * e * elem + K * elem)  # bias: random()'s
        if d + 1 < DEPTH:
            total += 3 * g * g * elem + 3 * g * elem + batch * width * 3 * g * elem
    m = sum(widths)
    total += batch * g * elem + batch * m * (8 + 4 + 4 + 4)
    total += batch * ((m + 1) * (4 + 4) + 4) + batch * (2 * (BUDGET + 1) * 4 + 4)
    return total


def _scaled_traffic(base, step, times):
    """``base`` + ``times`` x (``step`` - ``base``), kernel by kernel: (launches, read, written)."""
    names = set(base) | set(step)
    zero = (0, 0, 0)
    return {n: tuple(b + times * (s - b) for b, s in zip(base.get(n, zero), step.get(n, zero))) for n in names}


def round_traffic(emu, head, z, cand_ids, cand_base, root_state, roots, full_depth) -> dict:
    """Per kernel (launches, read bytes, written bytes) of one round: build_supertree over all D
    depths, then prune's select_top_b on its tree. Unless ``full_depth``, the supertree is emulated
    for its first 2 and 3 depths only and extended to D: depth 1 (one parent), every middle depth
    (W parents, W children, the GRU update) and the last (no update) each launch the same kernels
    over the same shapes, so T(D) = T(2) + (D - 2) x (T(3) - T(2)) (equal to the full emulation's
    count at both batch sizes: run with --full-depth to check; it takes ~8x longer)."""
    def supertree(depth):
        with emu.counting() as traffic:
            emu.build_supertree(head, z[:, :depth].contiguous(), cand_ids[:, :depth].contiguous(),
                                cand_base[:, :depth].contiguous(), root_state, WIDTH, BONUS)
        return traffic.per_kernel

    if full_depth:
        per_kernel = supertree(DEPTH)
    else:
        per_kernel = _scaled_traffic(supertree(2), supertree(3), DEPTH - 2)
    # prune's input: the full round's supertree, from the PyTorch reference (fast; same shape)
    tree = supertree_as_tree(*reference.build_supertree(head, z, cand_ids, cand_base, root_state, WIDTH, BONUS),
                             roots)
    with emu.counting() as traffic:
        emu.select_top_b(tree.parents, tree.scores, tree.num_nodes, BUDGET)
    for name, counts in traffic.per_kernel.items():
        per_kernel[name] = tuple(a + b for a, b in zip(per_kernel.get(name, (0, 0, 0)), counts))
    return per_kernel


def gpu_model_round(emu, name, spec, batch, launch_us, hbm_tbps, full_depth=False) -> dict:
    """One round's kernels under the instrumented emulator: counted traffic, the minimum, the
    modelled time (launches x launch_us + counted bytes / HBM bandwidth)."""
    head, z, cand_ids, cand_base, root_state, roots = round_inputs(spec, batch, torch.device("cpu"))
    if head.fc2_bias is None or head.b_hh is None:
        raise RuntimeError("min_bytes_per_round assumes a head with biases (CorrectionHeadWeights.random's)")
    per_kernel = round_traffic(emu, head, z, cand_ids, cand_base, root_state, roots, full_depth)
    launches = sum(c[0] for c in per_kernel.values())
    counted = sum(c[1] + c[2] for c in per_kernel.values())
    modelled = launches * launch_us + counted / (hbm_tbps * 1e12) * 1e6
    for kernel, (n, read, written) in sorted(per_kernel.items()):
        print(f"  batch {batch} {kernel}: {n} launches, {read} bytes read, {written} written", flush=True)
    return dict(head=name, dtype=str(spec["dtype"]).removeprefix("torch."), batch=batch, depth=DEPTH, k=K, width=WIDTH,
                budget=BUDGET, e=spec["e"], g=spec["g"], bytes_per_round=counted,
                min_bytes_per_round=min_bytes_per_round(spec, batch), launches_per_round=launches,
                modelled_us_per_round=round(modelled, 2))


def run_gpu_model(args) -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python_tests"))
    from emulated import FORWARD, EmulatedOps

    model = GPU_MODELS[args.gpu_model]
    hbm_tbps = args.hbm_tbps or model["hbm_tbps"]
    emu = EmulatedOps(schedule=FORWARD, instrumented=True)
    print(f"modelled on {model['name']} (not measured): {args.launch_us} us per launch, {hbm_tbps} TB/s HBM; "
          f"D={DEPTH} K={K} W={WIDTH} B={BUDGET}")
    print("| head | batch | launches | bytes | min bytes | bytes / min | modelled us | emulation s |")
    print("|---|---|---|---|---|---|---|---|")
    records = []
    for name in args.heads or ["4B"]:
        for batch in args.batch:
            start = time.perf_counter()
            record = gpu_model_round(emu, name, HEADS[name], batch, args.launch_us, hbm_tbps, args.full_depth)
            seconds = time.perf_counter() - start
            records.append(record)
            counted, minimum = record["bytes_per_round"], record["min_bytes_per_round"]
            print(f"| {name} | {batch} | {record['launches_per_round']} | {counted} | {minimum} | "
                  f"{counted / minimum:.2f} | {record['modelled_us_per_round']:.1f} | {seconds:.0f} |", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dartree_ext.build_info()["cuda"] else [])
    parser.add_argument("--device", nargs="+", default=default_devices)
    parser.add_argument("--heads", nargs="+", default=None, choices=list(HEADS),
                        help="default: both for timing, 4B for --gpu-model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq-heap-batch", type=int, default=1, help="requests timed for seq_heap (per request)")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="time each case at least this long (at least 3 repetitions; the median is reported)")
    parser.add_argument("--gpu-model", choices=list(GPU_MODELS),
                        help="model the round's GPU time from the emulated kernels' launches and bytes instead")
    parser.add_argument("--launch-us", type=float, default=4.0, help="--gpu-model: cost of one launch (us)")
    parser.add_argument("--hbm-tbps", type=float, default=None, help="--gpu-model: HBM bandwidth (TB/s)")
    parser.add_argument("--json", help="--gpu-model: write one record per head and batch to this path")
    parser.add_argument("--full-depth", action="store_true",
                        help="--gpu-model: emulate all D depths instead of extending 2 and 3 (about 8x slower)")
    args = parser.parse_args(argv)
    if args.gpu_model:
        return run_gpu_model(args)
    args.heads = args.heads or list(HEADS)
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
