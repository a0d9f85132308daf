"""Plain-PyTorch references of every op, for tests and benchmarks. Readable first, loop-free
where PyTorch allows; same signatures and outputs as :mod:`dartree_ext.ops`."""
from __future__ import annotations

import torch


def _valid_nodes(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    index = torch.arange(parents.shape[1], device=parents.device)
    return index[None, :] < num_nodes[:, None].long()


def _effective_parents(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """parents as int64 with -1 for the root and for padding."""
    index = torch.arange(parents.shape[1], device=parents.device)
    has_parent = _valid_nodes(parents, num_nodes) & (index[None, :] > 0)
    return torch.where(has_parent, parents.long(), torch.full_like(parents, -1, dtype=torch.long))


def ancestor_matrix(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool[B, N, N]: [b, i, j] iff node j is on node i's root path (itself included).

    Pointer doubling: after step k each row holds the ancestors less than 2^k levels up and
    ``jump`` points 2^k levels up (to a sentinel row N, all False, past the root).
    """
    batch, n_max = parents.shape
    par = _effective_parents(parents, num_nodes)
    jump = torch.where(par >= 0, par, n_max)
    jump = torch.cat([jump, torch.full((batch, 1), n_max, dtype=torch.long, device=parents.device)], 1)
    reach = torch.eye(n_max + 1, n_max, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    reach[:, n_max] = False
    for _ in range(max(1, n_max.bit_length())):
        reach = reach | torch.gather(reach, 1, jump[:, :, None].expand(-1, -1, n_max))
        jump = torch.gather(jump, 1, jump)
    return reach[:, :n_max]


def pack_bits(rows: torch.Tensor) -> torch.Tensor:
    """bool[..., N] -> int64[..., ceil(N / 64)], bit j of word w = rows[..., 64 w + j]."""
    n = rows.shape[-1]
    words = (n + 63) // 64
    padded = torch.nn.functional.pad(rows.long(), (0, words * 64 - n))
    weights = torch.ones(64, dtype=torch.long, device=rows.device) << torch.arange(64, device=rows.device)
    # distinct powers of two never carry, so the int64 sum is the exact bit pattern (bit 63 included)
    return (padded.view(*rows.shape[:-1], words, 64) * weights).sum(-1)


def tree_ancestor_bits(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    anc = ancestor_matrix(parents, num_nodes)
    depths = torch.where(_valid_nodes(parents, num_nodes), anc.sum(-1) - 1, -1).to(torch.int32)
    return pack_bits(anc), depths


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor, past_key_mask: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    anc = ancestor_matrix(parents, num_nodes)
    valid = _valid_nodes(parents, num_nodes)
    past = past_key_mask[:, None, :] & valid[:, :, None]
    visible = torch.cat([past, anc], dim=-1)
    hidden = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=parents.device)
    zero = torch.zeros((), dtype=dtype, device=parents.device)
    return torch.where(visible, zero, hidden)[:, None]


def _first_true(matrix: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where there is none (int32)."""
    first = matrix.long().argmax(-1)  # argmax returns the first maximal index
    return torch.where(matrix.any(-1), first, -1).to(torch.int32)


def tree_links(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    par = _effective_parents(parents, num_nodes)
    n_max = parents.shape[1]
    index = torch.arange(n_max, device=parents.device)
    is_child = par[:, None, :] == index[None, :, None]  # [b, i, j]: j is a child of i
    has_parent = par >= 0
    later_sibling = (
        (par[:, None, :] == par[:, :, None])
        & has_parent[:, :, None] & has_parent[:, None, :]
        & (index[None, None, :] > index[None, :, None])
    )
    return _first_true(is_child), _first_true(later_sibling)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step per tree level, vectorized over the batch."""
    batch, n_max = parents.shape
    par = _effective_parents(parents, num_nodes)
    rows = torch.arange(batch, device=parents.device)
    current = torch.zeros(batch, dtype=torch.long, device=parents.device)
    length = torch.zeros(batch, dtype=torch.long, device=parents.device)
    accept_nodes = torch.full((batch, n_max), -1, dtype=torch.int32, device=parents.device)
    accept_nodes[:, 0] = 0
    active = torch.ones(batch, dtype=torch.bool, device=parents.device)
    while bool(active.any()):
        wanted = target_tokens[rows, current]
        match = (par == current[:, None]) & (tokens == wanted[:, None])
        nxt = _first_true(match).long()
        active = active & (nxt >= 0)
        current = torch.where(active, nxt, current)
        length = length + active.long()
        accept_nodes[rows[active], length[active]] = current[active].to(torch.int32)
    return accept_nodes, length.to(torch.int32), target_tokens[rows, current]
