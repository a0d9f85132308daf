"""FlashInfer's bit-packed custom mask for a batch of draft trees.

FlashInfer's batch prefill wrappers (``BatchPrefillWithPagedKVCacheWrapper.plan(...,
packed_custom_mask=..., ...)``) take, per request, the bool mask ``[qo_len, kv_len]`` flattened
row-major and packed 8 entries a byte, little-endian (``segment_packbits(..., bitorder="little")``),
requests concatenated at byte offsets ``mask_indptr``. For a tree verified after a cached prefix
``qo_len = N`` and ``kv_len = seq_len + N``: every prefix column is visible and the tree part is
the ancestor mask. :func:`packed_custom_mask` builds it straight from the tree's ancestor bits
with one op (:func:`~dartree_ext.ops.packed_tree_mask`, CPU and CUDA), never materialising the
unpacked mask.
"""
from __future__ import annotations

import torch

from .. import ops
from ..tree import Tree


def mask_indptr(num_nodes: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """``int32[B + 1]`` byte offsets: request ``b`` takes ``ceil(N * (seq_lens[b] + N) / 8)`` bytes."""
    sizes = (num_nodes * (seq_lens.to(torch.int64) + num_nodes) + 7) // 8
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(torch.int32)


def packed_custom_mask(tree: Tree, seq_lens: torch.Tensor,
                       total_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed_custom_mask uint8[total_bytes], mask_indptr int32[B + 1])`` for verifying
    ``tree`` (``N`` nodes per request, padding included; a padding node sees the prefix and
    itself) after prefixes of ``seq_lens int[B]`` cached tokens. ``total_bytes`` (= the last
    offset) sizes the output without a host synchronisation; without it, it is read back from
    the device."""
    batch, n = tree.parents.shape
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [{batch}] (one length per request), got {list(seq_lens.shape)}")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be integers, got {seq_lens.dtype}")
    lens = seq_lens.to(device=tree.parents.device, dtype=torch.int64)
    indptr = mask_indptr(n, lens)
    if total_bytes is None:
        total_bytes = int(indptr[-1])
    bits, _ = ops.tree_ancestor_bits(tree.parents, tree.num_nodes, validate=False)
    return ops.packed_tree_mask(bits, lens, indptr, total_bytes), indptr
