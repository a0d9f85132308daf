"""Random and hand-built trees in the shared layout, for tests and benchmarks.

The layout is the one every op reads (:mod:`dartree_ext.ops`): ``parents int32[B, N]`` with
node 0 the root, parents before children, and ``num_nodes int32[B]``; padding parents are -1.

* :func:`random_tree` / :func:`random_batch`: seeded random trees of a few shapes;
* ``HAND_PARENTS``, ``HAND_NUM_NODES``, ``HAND_TOKENS``: one small tree whose op outputs are
  checked by hand in the tests.
"""
from __future__ import annotations

import torch

__all__ = ["HAND_NUM_NODES", "HAND_PARENTS", "HAND_TOKENS", "random_batch", "random_tree"]


def random_tree(num_nodes: int, n_max: int, generator: torch.Generator, kind: str = "random") -> torch.Tensor:
    """parents int32[n_max] of one request; padding entries are -1.

    kinds: "random" (parent uniform over earlier nodes), "chain", "star" (all children of the
    root), "bushy" (parent among the last few nodes: deep and wide).
    """
    parents = torch.full((n_max,), -1, dtype=torch.int32)
    for i in range(1, num_nodes):
        if kind == "chain":
            p = i - 1
        elif kind == "star":
            p = 0
        elif kind == "bushy":
            p = max(0, i - 1 - int(torch.randint(0, 4, (1,), generator=generator)))
        else:
            p = int(torch.randint(0, i, (1,), generator=generator))
        parents[i] = p
    return parents


def random_batch(batch: int, n_max: int, seed: int, kind: str = "random",
                 full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """parents int32[batch, n_max] and num_nodes int32[batch], each request its own size."""
    gen = torch.Generator().manual_seed(seed)
    counts = [n_max if (full or b == 0) else int(torch.randint(1, n_max + 1, (1,), generator=gen))
              for b in range(batch)]
    parents = torch.stack([random_tree(n, n_max, gen, kind) for n in counts])
    return parents, torch.tensor(counts, dtype=torch.int32)


# A hand-checked tree (8 slots, 7 nodes, node 7 is padding):
#   0 ─┬─ 1 (5) ─┬─ 3 (7)
#      │         └─ 4 (8) ── 6 (9)
#      └─ 2 (6) ──── 5 (7)
HAND_PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 4, -1]], dtype=torch.int32)
HAND_NUM_NODES = torch.tensor([7], dtype=torch.int32)
HAND_TOKENS = torch.tensor([[4, 5, 6, 7, 8, 7, 9, 0]], dtype=torch.int64)
