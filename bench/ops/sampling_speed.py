"""Time of drawing the target's token at T = 1 for N tree nodes over a 49152-token vocabulary:
the decoder's sampler (inverse CDF) against torch.multinomial, same process, same logits.

    python bench/ops/sampling_speed.py
"""
from __future__ import annotations

import time

import torch

from dartree_ext.sampling import target_tokens_from_logits


def _ms(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - start) / reps


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    print(f"threads={torch.get_num_threads()}")
    for nodes in (1, 4, 10, 20):
        logits = torch.randn(1, nodes, 49152).bfloat16()
        ours = _ms(lambda: target_tokens_from_logits(logits, temperature=1.0, generator=gen))
        ref = _ms(lambda: torch.multinomial(logits.float().softmax(-1)[0], 1, generator=gen))
        print(f"nodes {nodes:2d}: inverse CDF {ours:.3f} ms, multinomial {ref:.3f} ms, ratio {ref / ours:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
