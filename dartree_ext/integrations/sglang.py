"""SGLang's EAGLE verify inputs from a :class:`~dartree_ext.tree.Tree`, and its accept outputs
back to ours.

SGLang verifies a draft tree with one target forward (``EagleVerifyInput``) and walks it on the
GPU with ``verify_tree_greedy`` / ``tree_speculative_sampling_target_only``. The walk reads
first-child / next-sibling links (``retrive_next_token`` / ``retrive_next_sibling``) and global
node indices (``retrive_index = b * N + i``); attention reads a tree mask in one of three modes
(``TreeMaskMode``). :func:`verify_inputs` produces all of them from our layout (every request
padded to the same ``N``, so one shape per batch size, as CUDA graphs need);
:func:`accept_from_sglang` turns SGLang's ``accept_index`` / ``accept_token_num`` / ``predicts``
into our ``accept_nodes`` / ``accept_len`` / ``bonus`` (what :func:`~dartree_ext.ops.verify_tree`
returns). Both run on the inputs' device with no host synchronisation (given ``seq_lens_sum``
for the full mask, which SGLang keeps on the host).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import ops
from ..tree import Tree

# SGLang's TreeMaskMode values
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2
MASK_MODES = {"full": FULL_MASK, "qlen_only": QLEN_ONLY, "qlen_only_bitpacking": QLEN_ONLY_BITPACKING}


@dataclasses.dataclass
class SGLangVerifyInputs:
    """The fields of SGLang's ``EagleVerifyInput`` that describe the tree (SGLang's names)."""

    draft_token: torch.Tensor           # int64[bs * N]: node tokens, root first, request by request
    positions: torch.Tensor             # int64[bs * N]: seq_len + depth (padding nodes: seq_len)
    retrive_index: torch.Tensor         # int64[bs, N]: b * N + i
    retrive_next_token: torch.Tensor    # int64[bs, N]: lowest-index child, -1 for none
    retrive_next_sibling: torch.Tensor  # int64[bs, N]: next child of the same parent, -1 at the end
    custom_mask: torch.Tensor           # see verify_inputs
    draft_token_num: int                # N
    tree_mask_mode: int                 # FULL_MASK, QLEN_ONLY or QLEN_ONLY_BITPACKING
    topk: int                           # > 1: SGLang's non-causal (tree) mask path
    spec_steps: int                     # N - 1: an upper bound on the depth the walk may reach


def ancestor_matrix(tree: Tree) -> torch.Tensor:
    """``bool[B, N, N]``: ``[b, i, j]`` iff node ``j`` is on node ``i``'s root path (itself
    included; a padding node sees only itself), unpacked from :func:`~dartree_ext.ops.tree_ancestor_bits`."""
    bits, _ = ops.tree_ancestor_bits(tree.parents, tree.num_nodes, validate=False)
    n = tree.parents.shape[1]
    j = torch.arange(n, device=bits.device)
    words = bits[..., j // 64]                                   # [B, N, N]: the word holding bit j
    return ((words >> (j % 64)) & 1).bool()


def _full_mask(tree: Tree, anc: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int) -> torch.Tensor:
    """FULL_MASK: per request ``N x (seq_len + N)`` (prefix all visible, then the tree part),
    row-major, requests concatenated: ``N * seq_lens_sum + bs * N * N`` bools."""
    batch, n = tree.parents.shape
    device = anc.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    row = lens + n                                               # columns per row, per request
    sizes = row * n
    ends = sizes.cumsum(0)
    starts = ends - sizes
    t = torch.arange(n * seq_lens_sum + batch * n * n, device=device)
    b = torch.searchsorted(ends, t, right=True).clamp(max=max(batch - 1, 0))
    local = t - starts[b]
    i, c = local // row[b], local % row[b]
    col = (c - lens[b]).clamp(min=0)
    return (c < lens[b]) | anc[b, i, col]


def verify_inputs(tree: Tree, seq_lens: torch.Tensor, mask_mode: str = "full",
                  seq_lens_sum: int | None = None) -> SGLangVerifyInputs:
    """SGLang's verify inputs for ``tree`` (our layout) over requests whose committed lengths are
    ``seq_lens int[bs]`` (the tree's root is the last committed token, not yet in the cache, as in
    SGLang where it is the verified id of the previous round).

    ``mask_mode``:

    * ``"full"`` (FULL_MASK): ``bool[N * seq_lens_sum + bs * N * N]``, request by request its
      ``N`` rows of ``seq_len + N`` columns (``seq_lens_sum`` = ``sum(seq_lens)``; computed with
      a host synchronisation when not given);
    * ``"qlen_only"`` (QLEN_ONLY): ``bool[bs * N * N]``, the tree part only;
    * ``"qlen_only_bitpacking"`` (QLEN_ONLY_BITPACKING): one word per row, ``[bs * N]`` of
      ``uint8`` / ``uint16`` / ``uint32`` for ``N <= 8 / 16 / 32``, bit ``j`` (little-endian)
      set iff the row's node sees node ``j``; ``N > 32`` raises ``ValueError``.
    """
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {', '.join(MASK_MODES)}, got {mask_mode!r}")
    batch, n = tree.parents.shape
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [{batch}] (one length per request), got {list(seq_lens.shape)}")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be integers, got {seq_lens.dtype}")
    if mask_mode == "qlen_only_bitpacking" and n > 32:
        raise ValueError(f"qlen_only_bitpacking packs a row into one 32-bit word: N = {n} > 32 nodes")
    device = tree.parents.device
    next_token, next_sibling = ops.tree_links(tree.parents, tree.num_nodes, validate=False)
    index = (torch.arange(batch, device=device)[:, None] * n + torch.arange(n, device=device)[None]).to(torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64)
    positions = (lens[:, None] + tree.depths.clamp(min=0).to(torch.int64)).reshape(-1)
    if mask_mode == "qlen_only_bitpacking":
        bits, _ = ops.tree_ancestor_bits(tree.parents, tree.num_nodes, validate=False)
        word = bits[..., 0].reshape(-1)  # N <= 32: one 64-bit word holds the row, high bits 0
        mask = word.to(torch.uint8 if n <= 8 else torch.uint16 if n <= 16 else torch.uint32)
    else:
        anc = ancestor_matrix(tree)
        if mask_mode == "qlen_only":
            mask = anc.reshape(-1)
        else:
            if seq_lens_sum is None:
                seq_lens_sum = int(lens.sum())
            mask = _full_mask(tree, anc, lens, int(seq_lens_sum))
    return SGLangVerifyInputs(draft_token=tree.tokens.reshape(-1).to(torch.int64), positions=positions,
                              retrive_index=index, retrive_next_token=next_token.to(torch.int64),
                              retrive_next_sibling=next_sibling.to(torch.int64), custom_mask=mask,
                              draft_token_num=n, tree_mask_mode=MASK_MODES[mask_mode], topk=2,
                              spec_steps=max(1, n - 1))


def accept_from_sglang(accept_index: torch.Tensor, accept_token_num: torch.Tensor, predicts: torch.Tensor,
                       draft_token_num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's verify outputs as ours.

    ``accept_index int[bs, S + 1]``: global indices ``b * N + i`` of the accepted path, root first,
    -1 after; ``accept_token_num int[bs]``: accepted draft tokens; ``predicts int[bs * N]``: the
    target's token written at every accepted node (the bonus at the path's last). Returns
    ``accept_nodes int32[bs, N]`` (node indices within the request, -1 after the path),
    ``accept_len int32[bs]`` and ``bonus int64[bs]``, as :func:`~dartree_ext.ops.verify_tree`.
    """
    n = int(draft_token_num)
    if accept_index.dim() != 2:
        raise ValueError(f"accept_index must be [bs, steps + 1], got {list(accept_index.shape)}")
    batch, steps = accept_index.shape
    if accept_token_num.shape != (batch,):
        raise ValueError(f"accept_token_num must be [{batch}], got {list(accept_token_num.shape)}")
    if predicts.dim() != 1 or predicts.shape[0] != batch * n:
        raise ValueError(f"predicts must be [bs * draft_token_num] = [{batch * n}], got {list(predicts.shape)}")
    device = accept_index.device
    length = accept_token_num.to(torch.int64)
    base = torch.arange(batch, device=device, dtype=torch.int64)[:, None] * n
    j = torch.arange(steps, device=device)[None]
    nodes = torch.where(j <= length[:, None], accept_index.to(torch.int64) - base, -1)
    out = torch.full((batch, n), -1, dtype=torch.int32, device=device)
    width = min(n, steps)
    out[:, :width] = nodes[:, :width].to(torch.int32)
    last = accept_index.to(torch.int64).gather(1, length.clamp(max=steps - 1)[:, None])[:, 0]
    bonus = predicts.to(torch.int64)[last.clamp(min=0)]
    return out, accept_token_num.to(torch.int32), bonus
