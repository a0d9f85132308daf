"""Python wrappers, fake (meta) kernels and validation for the ops in ``torch.ops.dartree_ext``.

Tree layout shared by every op (per request ``b``, padded to ``N`` nodes):

* node 0 is the root (the last committed token), ``parents[b, 0]`` is ignored;
* ``parents int32[B, N]`` with ``0 <= parents[b, i] < i`` for every valid node ``0 < i < num_nodes[b]``
  (topological order); entries past ``num_nodes[b]`` are padding and are not read;
* ``num_nodes int32[B]`` in ``[1, N]``; ``N`` at most :data:`MAX_TREE_NODES`.

CPU ops check the tree's values (and raise ``ValueError``); CUDA ops check dtypes, shapes and
devices but not values, because that would synchronize the stream. Kernels stay memory-safe on
bad values (an invalid parent is read as "no parent"). Pass ``validate=True`` to check the values
of CUDA inputs too, at the cost of a synchronization.
"""
from __future__ import annotations

import torch

MAX_TREE_NODES = 8192

_ops = torch.ops.dartree_ext


def check_tree(parents: torch.Tensor, num_nodes: torch.Tensor, op: str = "dartree_ext") -> None:
    """Check the tree layout's values with tensor ops on any device (synchronizes on CUDA)."""
    if parents.dim() != 2 or num_nodes.dim() != 1 or num_nodes.shape[0] != parents.shape[0]:
        raise ValueError(f"{op}: parents must be [B, N] and num_nodes [B], got {tuple(parents.shape)} and "
                         f"{tuple(num_nodes.shape)}")
    n_max = parents.shape[1]
    bad_count = (num_nodes < 1) | (num_nodes > n_max)
    if bool(bad_count.any()):
        b = int(bad_count.nonzero()[0, 0])
        raise ValueError(f"{op}: num_nodes[{b}] = {int(num_nodes[b])} is outside [1, {n_max}]")
    index = torch.arange(n_max, device=parents.device)
    checked = (index > 0) & (index < num_nodes[:, None])
    bad = checked & ((parents < 0) | (parents >= index))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{op}: parents[{b}, {i}] = {int(parents[b, i])} breaks the tree layout; expected "
                         f"0 <= parent < {i} (nodes in topological order, parent before child)")


def _maybe_check(parents: torch.Tensor, num_nodes: torch.Tensor, validate: bool, op: str) -> None:
    # CPU kernels always check values themselves.
    if validate and parents.device.type != "cpu":
        check_tree(parents, num_nodes, op)


def tree_ancestor_bits(parents: torch.Tensor, num_nodes: torch.Tensor, *,
                       validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-packed root paths of every node.

    Returns ``bits int64[B, N, ceil(N / 64)]``, where bit ``j`` (little-endian within each
    64-bit word) of row ``i`` is set iff node ``j`` is on node ``i``'s root path, itself
    included, and ``depths int32[B, N]`` (root 0). Padding rows hold only their own bit and
    depth -1.
    """
    _maybe_check(parents, num_nodes, validate, "tree_ancestor_bits")
    return _ops.tree_ancestor_bits.default(parents, num_nodes)


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor, past_key_mask: torch.Tensor,
                        dtype: torch.dtype = torch.float32, *, validate: bool = False) -> torch.Tensor:
    """Additive tree-attention mask for HuggingFace attention, ``dtype[B, 1, N, P + N]``.

    Entry ``[b, 0, i, c]`` is 0 where node ``i`` may attend and ``finfo(dtype).min`` elsewhere.
    Columns ``c < P`` are the cached positions: visible iff ``past_key_mask[b, c]`` (bool[B, P],
    which carries left padding and holes). Column ``P + j`` is tree node ``j``: visible iff ``j``
    is on ``i``'s root path. Padding nodes see only themselves, so no row is fully hidden.
    """
    _maybe_check(parents, num_nodes, validate, "tree_attention_mask")
    return _ops.tree_attention_mask.default(parents, num_nodes, past_key_mask, dtype)


def tree_links(parents: torch.Tensor, num_nodes: torch.Tensor, *,
               validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links (the layout of sglang's speculative kernels).

    Returns ``next_token int32[B, N]`` (lowest-index child, -1 for a leaf) and
    ``next_sibling int32[B, N]`` (next child of the same parent in index order, -1 at the end).
    Padding nodes get -1 in both.
    """
    _maybe_check(parents, num_nodes, validate, "tree_links")
    return _ops.tree_links.default(parents, num_nodes)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                target_tokens: torch.Tensor, *,
                validate: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk a draft tree along the target's tokens.

    ``tokens int64[B, N]`` are the draft tokens (``tokens[b, 0]`` the root's), and
    ``target_tokens int64[B, N]`` the target's token after each node (argmax at T = 0, a sample
    at T > 0; see :func:`dartree_ext.target_tokens_from_logits`). From the root, while a child
    of the current node carries the target's token, move to it (the lowest index if several).

    Returns ``accept_nodes int32[B, N]`` (the path, root first, padded with -1),
    ``accept_len int32[B]`` (accepted draft nodes, root excluded) and ``bonus int64[B]`` (the
    target's token after the last accepted node).
    """
    _maybe_check(parents, num_nodes, validate, "verify_tree")
    return _ops.verify_tree.default(tokens, parents, num_nodes, target_tokens)


# Fake kernels: shapes and dtypes only, for torch.compile, CUDA graphs and FakeTensor tracing.
# They check devices as the real kernels do, so a device mix fails while tracing too.

def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; "
                               "all inputs must be on one device")


@torch.library.register_fake("dartree_ext::tree_ancestor_bits")
def _tree_ancestor_bits_fake(parents, num_nodes):
    _check_same_device("tree_ancestor_bits", parents=parents, num_nodes=num_nodes)
    batch, n_max = parents.shape
    words = (n_max + 63) // 64
    return parents.new_empty((batch, n_max, words), dtype=torch.int64), parents.new_empty((batch, n_max))


@torch.library.register_fake("dartree_ext::tree_attention_mask")
def _tree_attention_mask_fake(parents, num_nodes, past_key_mask, dtype):
    _check_same_device("tree_attention_mask", parents=parents, num_nodes=num_nodes, past_key_mask=past_key_mask)
    batch, n_max = parents.shape
    return parents.new_empty((batch, 1, n_max, past_key_mask.shape[1] + n_max), dtype=dtype)


@torch.library.register_fake("dartree_ext::tree_links")
def _tree_links_fake(parents, num_nodes):
    _check_same_device("tree_links", parents=parents, num_nodes=num_nodes)
    return torch.empty_like(parents), torch.empty_like(parents)


@torch.library.register_fake("dartree_ext::verify_tree")
def _verify_tree_fake(tokens, parents, num_nodes, target_tokens):
    _check_same_device("verify_tree", parents=parents, num_nodes=num_nodes, tokens=tokens,
                       target_tokens=target_tokens)
    batch = parents.shape[0]
    return torch.empty_like(parents), parents.new_empty((batch,)), tokens.new_empty((batch,))
