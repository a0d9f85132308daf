"""Target forward cost on this machine: tokens/s of a 256-token forward, and the time of a
1-token and a 65-token (root + 64-node tree) forward, per dtype and thread count.

    python bench/forward_speed.py --target smollm2
"""
from __future__ import annotations

import argparse
import time

import torch

from dartree_ext.loading import load_target


def timed(model, ids) -> float:
    with torch.no_grad():
        model(ids)
        start = time.perf_counter()
        model(ids)
        return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--threads", default="1,2")
    args = p.parse_args(argv)
    print(f"{'dtype':10s} {'threads':>7s} {'256 tok/s':>10s} {'65 tok ms':>10s} {'1 tok ms':>9s}")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_target(args.target, dtype=dtype).target
        vocab = model.config.vocab_size
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            t256 = timed(model, torch.randint(0, vocab, (1, 256)))
            t65 = timed(model, torch.randint(0, vocab, (1, 65)))
            t1 = timed(model, torch.randint(0, vocab, (1, 1)))
            print(f"{str(dtype).split('.')[-1]:10s} {threads:7d} {256 / t256:10.0f} {1e3 * t65:10.1f} {1e3 * t1:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
