"""VAT loss benchmark: forward + backward time and peak memory of ours vs the PyTorch reference.

    python bench/ops/vat.py                                   # M*K = 4096 positions, V = 49152, CPU (+ CUDA)
    python bench/ops/vat.py --positions 512 --vocab 8192      # a quick run
    python bench/ops/vat.py --device cuda --dtype bfloat16

Cases (each in a fresh subprocess, so one case's memory cannot hide another's):
  vat_loss           ours, from materialized logits [M, K, V] (inputs: draft + target logits)
  reference          dartree_ext.reference.vat_loss on the same logits
  vat_loss_linear    ours, from hidden states and head weights (no [M, K, V] logits)
  reference_linear   logits = hidden @ W.T (materialized), then the reference
Time: median of --reps forward + backward passes (greedy rule, "vat" schedule, with a verification
head). Peak memory: what one forward + backward allocates beyond its inputs. On CUDA that is
torch.cuda.max_memory_allocated() minus the memory allocated before the pass; on the CPU it is the
peak resident set size during the pass (VmHWM, reset through /proc/self/clear_refs right before it)
minus the resident set size before it: the pages the pass's tensors touched at their peak, allocator
slack included (glibc returns large freed blocks to the OS, so freed tensors do not count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

CASES = ("vat_loss", "reference", "vat_loss_linear", "reference_linear")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(args) -> dict:
    import dartree_ext
    from dartree_ext import reference

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    m, k, vocab = args.positions // args.block, args.block, args.vocab
    linear = args.case.endswith("linear")
    # inputs created in their own dtype directly (no transient float64 copies)
    tokens = torch.randint(0, vocab, (m, k), device=device)
    valid = torch.ones(m, k, dtype=torch.bool, device=device)
    valid[::3, k - 2:] = False
    vh = torch.randn(m, k, device=device, dtype=dtype)
    if linear:
        h_d = torch.randn(m, k, args.hidden, device=device, dtype=dtype)
        w_d = torch.randn(vocab, args.hidden, device=device, dtype=dtype) / args.hidden ** 0.5
        h_t = torch.randn(m, k, args.hidden, device=device, dtype=dtype)
        w_t = (w_d + 0.3 * torch.randn(vocab, args.hidden, device=device, dtype=dtype) / args.hidden ** 0.5) * 2
        leaves = [h_d, w_d, vh]
    else:
        target = 2 * torch.randn(m, k, vocab, device=device, dtype=dtype)
        draft = target + torch.randn(m, k, vocab, device=device, dtype=dtype)
        leaves = [draft, vh]
    for t in leaves:
        t.requires_grad_(True)

    def step():
        for t in leaves:
            t.grad = None
        if args.case == "vat_loss":
            out = dartree_ext.vat_loss(draft, target, tokens, vh, valid)
        elif args.case == "reference":
            out = reference.vat_loss(draft, target, tokens, vh, valid)
        elif args.case == "vat_loss_linear":
            out = dartree_ext.vat_loss_linear(h_d, w_d, h_t, w_t, tokens, vh, valid, chunk_size=args.chunk_size)
        else:
            out = reference.vat_loss(h_d @ w_d.t(), h_t @ w_t.t(), tokens, vh, valid)
        out.loss.backward()
        return out

    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = step()
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    else:
        _reset_peak_rss()
        before = _status_mib("VmRSS")
        out = step()
        peak = _status_mib("VmHWM") - before
    loss = float(out.loss)
    times = []
    for _ in range(args.reps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"case": args.case, "time_ms": 1000 * statistics.median(times), "peak_mib": peak, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=4096, help="M * K")
    parser.add_argument("--block", type=int, default=16, help="K, positions per block")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size of the linear variant's heads")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", nargs="*", default=None, help="cpu and/or cuda (default: cpu, and cuda if present)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None, help="vat_loss_linear's chunk_size (positions)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args()
    if args.case is not None:
        args.device = args.device[0]
        print(json.dumps(run_case(args)))
        return
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    print(f"M*K = {args.positions} (K = {args.block}), V = {args.vocab}, hidden = {args.hidden}, {args.dtype}, "
          f"forward + backward, median of {args.reps}")
    print("| device | case | time (ms) | peak beyond inputs (MiB) | loss |")
    print("|---|---|---|---|---|")
    results = {}
    for device in devices:
        for case in args.cases:
            cmd = [sys.executable, __file__, "--case", case, "--device", device, "--positions", str(args.positions),
                   "--block", str(args.block), "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype",
                   args.dtype, "--reps", str(args.reps)]
            if args.chunk_size is not None:
                cmd += ["--chunk-size", str(args.chunk_size)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"| {device} | {case} | failed: {done.stderr.strip().splitlines()[-1]} | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results[(device, case)] = r
            print(f"| {device} | {case} | {r['time_ms']:.1f} | {r['peak_mib']:.0f} | {r['loss']:.4f} |", flush=True)
    for device in devices:
        pairs = [("vat_loss", "reference"), ("vat_loss_linear", "reference_linear")]
        for ours, ref in pairs:
            if (device, ours) in results and (device, ref) in results:
                a, b = results[(device, ours)], results[(device, ref)]
                print(f"{device}: {ours} / {ref}: time {a['time_ms'] / b['time_ms']:.2f}x, "
                      f"peak memory {a['peak_mib'] / max(b['peak_mib'], 1e-9):.3f}x")


if __name__ == "__main__":
    main()
