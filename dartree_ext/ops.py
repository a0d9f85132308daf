"""Python wrappers, fake (meta) kernels and validation for the ops in ``torch.ops.dartree_ext``.

Tree layout shared by every op (per request ``b``, padded to ``N`` nodes):

* node 0 is the root (the last committed token), ``parents[b, 0]`` is ignored;
* ``parents int32[B, N]`` with ``0 <= parents[b, i] < i`` for every valid node ``0 < i < num_nodes[b]``
  (topological order); entries past ``num_nodes[b]`` are padding and are not read;
* ``num_nodes int32[B]`` in ``[1, N]``; ``N`` at most :data:`MAX_TREE_NODES`.

Validation (``docs/architecture.md``, "Validation"): every op checks dtypes, shapes, devices,
sizes and their bounds always. CPU ops also check the values they read anyway (tree layout,
token ids, positions) and raise ``ValueError``. The wrappers' ``validate=True`` (the default)
adds the data checks a kernel cannot make cheaply: the same values on CUDA (a synchronization),
and NaN scores on every device. The decoding loop, which builds its trees itself, passes
``validate=False``. Kernels stay memory-safe on bad values either way (an invalid parent is read
as "no parent", an out-of-range candidate id as a candidate of score -inf).
"""
from __future__ import annotations

import functools

import torch

from ._widths import depth_widths

__all__ = ["MAX_HEAP_BUDGET", "MAX_TREE_NODES", "amx_linear", "build_supertree", "check_tree", "compact_kv_", "compact_kv_layers_", "compact_kv_paged_",
           "ddtree_heap",
           "expand_depth", "few_rows_attention", "few_rows_linear", "pack_amx", "packed_tree_mask", "quant_linear", "quant_linear_int8", "rms_norm_rows", "rotary_rows", "rotary_tables", "silu_mul",
           "select_top_b", "select_top_w", "tokens_from_logits", "tree_ancestor_bits",
           "tree_attention_mask", "tree_links", "validate_inputs", "verify_tree"]

MAX_TREE_NODES = 8192
MAX_HEAP_BUDGET = 2048

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


def _layout_ok(parents: torch.Tensor, num_nodes: torch.Tensor) -> bool:
    return (parents.dim() == 2 and num_nodes.dim() == 1 and num_nodes.shape[0] == parents.shape[0]
            and parents.dtype == torch.int32 and num_nodes.dtype == torch.int32
            and 1 <= parents.shape[1] <= MAX_TREE_NODES and parents.device == num_nodes.device)


def _refuse_nan(op: str, name: str, values: torch.Tensor, live: torch.Tensor | None = None, *,
                scores: bool = True) -> None:
    """A ``ValueError`` naming the first bad entry of ``values`` (where ``live``, if given): NaN or
    +inf for ``scores`` (-inf is "none"), else (an activation) any non-finite value."""
    if not values.is_floating_point():
        return
    bad = (values < float("inf")).logical_not_() if scores else values.isfinite().logical_not_()  # one pass
    if live is not None:
        bad &= live
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        where = f"{op}: {name}[{', '.join(map(str, at))}]"
        if scores:
            raise ValueError(f"{where} is {'NaN' if bool(values[at].isnan()) else '+inf'}; scores must be numbers "
                             "(-inf for none)")
        raise ValueError(f"{where} = {float(values[at])} is not finite")


def _refuse_ids(op: str, name: str, ids: torch.Tensor, vocab: int | None = None) -> None:
    """A ``ValueError`` naming the first entry of ``ids`` that is negative (or ``>= vocab``)."""
    bad = ids < 0 if vocab is None else (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        span = "negative" if vocab is None else f"outside [0, {vocab})"
        raise ValueError(f"{op}: {name}[{', '.join(map(str, at))}] = {int(ids[at])} is not a token id ({span})")


def _live(num: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, size]``: True where the index is below ``num[b]``."""
    return torch.arange(size, device=num.device)[None] < num[:, None].long()


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


# What ``validate=True`` adds, one function per op taking the op's arguments. ``on_device``: the
# inputs go to a CUDA kernel, so the value checks the CPU kernels make themselves (tree layout,
# counts, token ids, sorted log-probs) run here first, on the device (a synchronization). A bad
# layout (dtype, rank, batch, size) is left to the op's own checks, so the error is the same on
# every device. :func:`validate_inputs` runs them by name.

def _validate_tree(op: str, parents, num_nodes, *_, on_device: bool) -> None:
    if on_device and _layout_ok(parents, num_nodes):
        check_tree(parents, num_nodes, op)


def _validate_verify_tree(tokens, parents, num_nodes, target_tokens, *, on_device: bool) -> None:
    _validate_tree("verify_tree", parents, num_nodes, on_device=on_device)
    if on_device and _layout_ok(parents, num_nodes) and tokens.shape == parents.shape:
        live = _live(num_nodes, parents.shape[1])
        _refuse_ids("verify_tree", "tokens", torch.where(live & (torch.arange(parents.shape[1], device=live.device) > 0),
                                                         tokens, 0))
        if target_tokens.shape == parents.shape:
            _refuse_ids("verify_tree", "target_tokens", torch.where(live, target_tokens, 0))


def _refuse_count(op: str, name: str, counts: torch.Tensor, most: int, on_device: bool) -> None:
    if on_device:
        bad = (counts < 0) | (counts > most)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"{op}: {name}[{b}] = {int(counts[b])} is outside [0, {most}]")


def _validate_select_top_w(parent_scores, child_logprobs, num_parents, width, *, on_device: bool) -> None:
    if parent_scores.dim() == 2 and num_parents.dim() == 1:
        _refuse_count("select_top_w", "num_parents", num_parents, parent_scores.shape[1], on_device)
    if parent_scores.dim() == 2 and child_logprobs.dim() == 3 and num_parents.dim() == 1 \
            and child_logprobs.shape[:2] == parent_scores.shape and num_parents.shape[0] == parent_scores.shape[0]:
        live = _live(num_parents, parent_scores.shape[1])
        _refuse_nan("select_top_w", "parent_scores", parent_scores, live)
        _refuse_nan("select_top_w", "child_logprobs", child_logprobs, live[..., None])


def _validate_select_top_b(parents, scores, num_nodes, budget, *, on_device: bool) -> None:
    _validate_tree("select_top_b", parents, num_nodes, on_device=on_device)
    if _layout_ok(parents, num_nodes) and scores.shape == parents.shape:
        _refuse_nan("select_top_b", "scores", scores, _live(num_nodes, parents.shape[1]))


def _validate_ddtree_heap(logprobs, token_ids, root_tokens, budget, *, on_device: bool) -> None:
    if not on_device or logprobs.dim() != 3:
        return
    nan = logprobs.isnan()
    unsorted = (logprobs[..., 1:] > logprobs[..., :-1]) | nan[..., 1:] | nan[..., :-1]
    if bool(unsorted.any()):
        b, d, j = (int(v) for v in unsorted.nonzero()[0])
        raise ValueError(f"ddtree_heap: logprobs[{b}, {d}] must be sorted in descending order (and free of "
                         f"NaN); entries {j} and {j + 1} are not")
    if logprobs.shape[-1] and bool((logprobs[..., 0] == float("inf")).any()):
        b, d = (int(v) for v in (logprobs[..., 0] == float("inf")).nonzero()[0])
        raise ValueError(f"ddtree_heap: logprobs[{b}, {d}, 0] = inf is not a log-probability (NaN or +inf)")
    _refuse_ids("ddtree_heap", "token_ids", token_ids)
    _refuse_ids("ddtree_heap", "root_tokens", root_tokens)


def _validate_candidates(op: str, head, z, cand_ids, cand_base, on_device: bool) -> None:
    if on_device and cand_ids.dtype == torch.long:
        _refuse_ids(op, "cand_ids", cand_ids, int(head.gru_table.shape[0]))
    _refuse_nan(op, "cand_base", cand_base)
    _refuse_nan(op, "z", z, scores=False)


def _validate_expand_depth(head, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width,
                           depth_bonus=-0.2, *, on_device: bool) -> None:
    _validate_candidates("expand_depth", head, z, cand_ids, cand_base, on_device)
    if parent_scores.dim() == 2 and num_parents.dim() == 1 and num_parents.shape[0] == parent_scores.shape[0]:
        _refuse_count("expand_depth", "num_parents", num_parents, parent_scores.shape[1], on_device)
        live = _live(num_parents, parent_scores.shape[1])
        _refuse_nan("expand_depth", "parent_scores", parent_scores, live)
        if parent_states.dim() == 3 and parent_states.shape[:2] == parent_scores.shape:
            _refuse_nan("expand_depth", "parent_states", parent_states, live[..., None], scores=False)


def _validate_build_supertree(head, z, cand_ids, cand_base, root_state, width, depth_bonus=-0.2, *,
                              on_device: bool) -> None:
    _validate_candidates("build_supertree", head, z, cand_ids, cand_base, on_device)
    _refuse_nan("build_supertree", "root_state", root_state, scores=False)


def _validate_compact_kv_paged(caches, block_table, src_positions, dst_start, lengths, *, on_device: bool) -> None:
    if on_device and caches:
        # the CPU op's checks on host copies, over an empty stand-in pool of the same pages
        stand_in = torch.empty(caches[0].shape[0], caches[0].shape[1], 0, dtype=caches[0].dtype)
        _ops.compact_kv_paged_.default([stand_in], block_table.cpu(), src_positions.cpu(), dst_start.cpu(),
                                       lengths.cpu())


_VALIDATORS = {
    **{op: functools.partial(_validate_tree, op) for op in ("tree_ancestor_bits", "tree_attention_mask", "tree_links")},
    "verify_tree": _validate_verify_tree,
    "select_top_w": _validate_select_top_w,
    "select_top_b": _validate_select_top_b,
    "ddtree_heap": _validate_ddtree_heap,
    "expand_depth": _validate_expand_depth,
    "build_supertree": _validate_build_supertree,
    "compact_kv_paged_": _validate_compact_kv_paged,
}


def validate_inputs(op: str, *args, on_device: bool = True) -> None:
    """The data checks ``op``'s wrapper makes with ``validate=True``, on the op's positional
    arguments (``ValueError`` naming the argument and the entry). ``on_device=True`` adds the
    value checks the CPU kernels make themselves, as the wrapper does before a CUDA kernel; the
    tests' CUDA emulation runs them before the emulated kernels, so the CUDA path's checks are
    tested without a GPU."""
    if op not in _VALIDATORS:
        raise ValueError(f"validate_inputs: no data checks for {op!r}; ops with them: {', '.join(sorted(_VALIDATORS))}")
    _VALIDATORS[op](*args, on_device=on_device)


def tree_ancestor_bits(parents: torch.Tensor, num_nodes: torch.Tensor, *,
                       validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-packed root paths of every node.

    Returns ``bits int64[B, N, ceil(N / 64)]``, where bit ``j`` (little-endian within each
    64-bit word) of row ``i`` is set iff node ``j`` is on node ``i``'s root path, itself
    included, and ``depths int32[B, N]`` (root 0). Padding rows hold only their own bit and
    depth -1.
    """
    if validate:
        _validate_tree("tree_ancestor_bits", parents, num_nodes, on_device=_on_device(parents))
    return _ops.tree_ancestor_bits.default(parents, num_nodes)


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor, past_key_mask: torch.Tensor,
                        dtype: torch.dtype = torch.float32, *, validate: bool = True) -> torch.Tensor:
    """Additive tree-attention mask for HuggingFace attention, ``dtype[B, 1, N, P + N]``.

    Entry ``[b, 0, i, c]`` is 0 where node ``i`` may attend and ``finfo(dtype).min`` elsewhere.
    Columns ``c < P`` are the cached positions: visible iff ``past_key_mask[b, c]`` (bool[B, P],
    which carries left padding and holes). Column ``P + j`` is tree node ``j``: visible iff ``j``
    is on ``i``'s root path. Padding nodes see only themselves, so no row is fully hidden.
    """
    if validate:
        _validate_tree("tree_attention_mask", parents, num_nodes, on_device=_on_device(parents))
    return _ops.tree_attention_mask.default(parents, num_nodes, past_key_mask, dtype)


def tree_links(parents: torch.Tensor, num_nodes: torch.Tensor, *,
               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links (the layout of sglang's speculative kernels).

    Returns ``next_token int32[B, N]`` (lowest-index child, -1 for a leaf) and
    ``next_sibling int32[B, N]`` (next child of the same parent in index order, -1 at the end).
    Padding nodes get -1 in both.
    """
    if validate:
        _validate_tree("tree_links", parents, num_nodes, on_device=_on_device(parents))
    return _ops.tree_links.default(parents, num_nodes)


def packed_tree_mask(bits: torch.Tensor, seq_lens: torch.Tensor, mask_indptr: torch.Tensor,
                     total_bytes: int) -> torch.Tensor:
    """FlashInfer's packed custom mask (``packed_custom_mask`` of its batch prefill wrappers).

    For request ``b`` the bool mask ``[N, seq_lens[b] + N]`` (every prefix column visible, then
    the tree part from the ancestor rows ``bits int64[B, N, ceil(N / 64)]`` of
    :func:`tree_ancestor_bits`), flattened row-major and packed 8 entries a byte, little-endian,
    into ``uint8[total_bytes]`` at ``mask_indptr int32[B + 1]`` (byte offsets: request ``b`` takes
    ``ceil(N * (seq_lens[b] + N) / 8)`` bytes, its last byte zero-padded). ``seq_lens`` is int64.
    :func:`dartree_ext.integrations.flashinfer.packed_custom_mask` computes the offsets.
    """
    return _ops.packed_tree_mask.default(bits, seq_lens, mask_indptr, int(total_bytes))


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                target_tokens: torch.Tensor, *,
                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk a draft tree along the target's tokens.

    ``tokens int64[B, N]`` are the draft tokens (``tokens[b, 0]`` the root's), and
    ``target_tokens int64[B, N]`` the target's token after each node (argmax at T = 0, a sample
    at T > 0; see :func:`dartree_ext.target_tokens_from_logits`). From the root, while a child
    of the current node carries the target's token, move to it (the lowest index if several).

    Returns ``accept_nodes int32[B, N]`` (the path, root first, padded with -1),
    ``accept_len int32[B]`` (accepted draft nodes, root excluded) and ``bonus int64[B]`` (the
    target's token after the last accepted node).
    """
    if validate:
        _validate_verify_tree(tokens, parents, num_nodes, target_tokens, on_device=_on_device(parents))
    return _ops.verify_tree.default(tokens, parents, num_nodes, target_tokens)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows of ``x`` (at most 256; CPU, float32 or bfloat16):
    the linear layers of a verification forward.

    ``x [..., K]``, ``weight [N, K]`` (contiguous, the dtype of ``x``), ``bias [N]`` or ``None``.
    Each weight row is read once per call and dotted with every row of ``x`` (a library GEMM packs
    the weights on each call, so its cost grows with the rows long before the arithmetic does).
    Batch-invariant: row ``m`` of the result is bit-identical to the result for ``x[m]`` alone, so a
    tree verification rounds like a plain step. Products accumulate in float32 (bfloat16 weights
    are widened exactly; the result is rounded once, at the end). AVX-512 (F, and BW + VL for
    bfloat16) where the CPU has it, else AVX2 + FMA (the same bits), else a portable loop
    (``build_info()["few_rows_linear"]`` says which). ``bias`` has the dtype of ``x``. No autograd.
    """
    return _ops.few_rows_linear.default(x, weight, bias)


AMX_TILE = (16, 32)  # (outputs, inputs) of one packed weight tile


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bfloat16, K a multiple of 32) in :func:`amx_linear`'s layout: ``[ceil(N / 16),
    K / 32, 512]`` bfloat16, tile ``[nb, kb]`` holding at ``(r * 16 + c) * 2 + e`` the weight
    ``W[nb * 16 + c, kb * 32 + 2 r + e]`` (TDPBF16PS's B operand; outputs past N are zeros). The same
    values, rearranged: as many bytes as ``weight`` (and a partial block of outputs)."""
    outs, ins = AMX_TILE
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"pack_amx: weight must be a bfloat16 [N, K] matrix, got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {list(getattr(weight, 'shape', []))}")
    n, k = weight.shape
    if n == 0 or k == 0 or k % ins:
        raise ValueError(f"pack_amx: weight must have N > 0 outputs and K a positive multiple of {ins} inputs, "
                         f"got [{n}, {k}]")
    blocks = -(-n // outs)
    w = weight.detach()
    if blocks * outs != n:
        w = torch.cat([w, w.new_zeros(blocks * outs - n, k)])
    # [nb, c, kb, r, e] -> [nb, kb, r, c, e]
    return w.reshape(blocks, outs, k // ins, ins // 2, 2).permute(0, 2, 3, 1, 4).reshape(blocks, k // ins, outs * ins)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 through Intel AMX tiles, ``W [out_features, K]`` packed by
    :func:`pack_amx`, for a few rows of ``x [..., K]`` (at most 256; CPU, bfloat16, K a multiple of
    32). Each output element is a float32 accumulator over K in order (one TDPBF16PS a 32 inputs;
    bfloat16 products are exact), plus the bias, rounded to bfloat16 once. Batch-invariant: row
    ``m`` is bit-identical to the result for ``x[m]`` alone (a tree verification rounds like a plain
    step), and the weights stream through once per 32 rows (1 to 16 rows cost about the same).
    The bits differ from :func:`few_rows_linear`'s (another summation order). Needs AMX-BF16 and
    the kernel's grant of the tile state (``build_info()["amx_linear"] == "amx_bf16"``); else
    ``RuntimeError``. No autograd."""
    return _ops.amx_linear.default(x, packed, out_features, bias)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` where ``W`` stays in a GGUF's blocks: ``blocks uint8[N, K / 32 * bytes]``,
    each row ``K / 32`` blocks of 32 weights in ggml's layout for ``kind`` (``"q4_0"``: 18 bytes,
    ``"q4_1"``: 20, ``"q8_0"``: 34; :mod:`dartree_ext.quant`). For a few rows of ``x`` (at most 256;
    CPU, float32 or bfloat16): each block is read once per call and de-quantized in registers,
    never to memory.

    The weights are de-quantized exactly as :func:`dartree_ext.quant.dequantize` does, and every
    output element accumulates in :func:`few_rows_linear`'s float32 order: for float32 ``x`` the
    result is bit-identical to ``few_rows_linear(x, dequantize(blocks, kind))`` on its AVX-512 path,
    and batch-invariant (row ``m`` equals the result for ``x[m]`` alone). AVX-512 where the CPU has
    it (``build_info()["quant_linear"]``), else a portable loop with the same bits. No autograd.
    """
    return _ops.quant_linear.default(x, blocks, kind, bias)


def quant_linear_int8(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`quant_linear` with ``x`` rounded to 8 bits a block of 32 inputs (``dx = max|x| / 127``,
    as llama.cpp does), over ``blocks`` repacked by :func:`dartree_ext.quant.pack_int8` (16 blocks
    to 16 lanes: the same bytes, rearranged), so the integer codes meet ``x`` in integer dot
    products and each block's scale is applied once (AVX-512 VNNI where the CPU has it,
    ``build_info()["quant_linear_int8"]``; else a portable loop with the same bits). Batch-invariant;
    the results differ from :func:`quant_linear`'s by the rounding of ``x`` (the arithmetic:
    ``csrc/cpu/quant_linear_int8.cpp``; the reference, on the GGUF layout:
    :func:`dartree_ext.reference.quant_linear_int8`). CPU only, no autograd.
    """
    return _ops.quant_linear_int8.default(x, blocks, kind, bias)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A drafter's RMSNorm, ``weight * (x / sqrt(mean(x^2) + eps))``, in one call (CPU, float32 or
    bfloat16 ``x [..., H]``, ``weight [H]`` of its dtype): in float32, the normalized row rounded to
    the dtype and the product rounded again, as :class:`dartree_ext.models.drafter.RMSNorm` does in
    eight ATen calls. No autograd."""
    return _ops.rms_norm_rows.default(x, weight, eps)


def rotary_rows(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [B, H, T, Dh]`` (CPU, float32 or bfloat16, unit stride
    in Dh) at ``positions int64[B or 1, T]`` with base ``theta``, in one call: float32 math, one
    rounding to the dtype, as the drafter's ``_rope`` does in about 17 ATen calls. Returns a
    contiguous tensor. No autograd."""
    return _ops.rotary_rows.default(x, positions, theta)


def rotary_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers model's rotate-half rotary embedding (``apply_rotary_pos_emb``) of ``q`` and
    ``k [B, H, T, Dh]`` (CPU, float32 or bfloat16, unit stride in Dh, any other strides) with its
    ``cos`` / ``sin`` tables ``[B or 1, T, Dh]`` of the same dtype, in one call:
    ``x * cos + rotate_half(x) * sin`` with each product and the sum rounded to the dtype as the
    PyTorch form's calls round them (the same values; a NaN's payload may differ). Returns
    contiguous tensors. No autograd."""
    return _ops.rotary_tables.default(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's ``silu(gate) * up`` in one call (CPU, float32 or bfloat16, ``up`` of
    ``gate``'s shape and dtype): silu rounded to the dtype, then the product rounded, as the two
    PyTorch calls round them; silu's ``exp`` is a polynomial (relative error about 1e-7), so a
    value can differ from PyTorch's by a few units in the last place in float32, rarely by one in
    bfloat16. Returns a contiguous tensor. No autograd."""
    return _ops.silu_mul.default(gate, up)


def tokens_from_logits(logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """The target's token at each node from ``logits [..., V]`` (CPU, float32 or bfloat16), in one
    call: ``temperature == 0`` the first maximum (ties to the lowest id); ``temperature > 0`` a
    sample of ``softmax(logits / temperature)`` by the inverse CDF at ``uniforms`` (float32 in
    [0, 1), one per row, checked): the first token whose cumulative probability exceeds ``u``,
    never one of zero probability. Returns ``int64[...]``. A row holding a NaN, or all -inf, is
    refused with a ``ValueError`` naming it (no token can be drawn from it); a +inf logit takes
    all the mass.
    :func:`dartree_ext.sampling.target_tokens_from_logits` uses it where it applies (no top-k /
    top-p)."""
    return _ops.tokens_from_logits.default(logits, uniforms, temperature)


def few_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
                       scale: float | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` for a few query rows (CPU, float32 or bfloat16): a
    verification forward's root + tree, or a plain step's one row, against the KV cache.

    ``query [B, H, T, D]``, ``key [B, H_kv, S, D]``, ``value [B, H_kv, S, Dv]`` (last dims
    contiguous, one dtype; query head ``h`` reads key/value head ``h // (H / H_kv)``, at most 16
    query heads per key/value head, head dims at most 256), ``mask`` additive and floating-point,
    ``[B or 1, 1, T or 1, S]`` (0 visible, a value <= -1e30 such as the dtype's minimum hidden), or
    ``None``; ``scale`` defaults to ``D ** -0.5``. Returns ``[B, H, T, Dv]`` in the query's dtype,
    accumulated in float32.

    Row-invariant: a row's result is the same bits whatever the other rows of the call, and whatever
    hidden keys lie between its visible ones, because hidden keys are skipped (softmax gives them
    weight exactly 0 whenever the row sees a key) and every sum runs over the visible keys in
    order. A tree node attending to the prefix and its ancestors therefore gets exactly what the
    same token gets in a plain decoding step. A row that sees no key attends to all keys, and a row of -inf
    scores gives 0 (both as SDPA does). Scratch: a float32 copy of the keys and values of one
    key/value head per thread. No autograd."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ops.few_rows_attention.default(query, key, value, mask, scale)


def select_top_w(parent_scores: torch.Tensor, child_logprobs: torch.Tensor, num_parents: torch.Tensor,
                 width: int, *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``width`` best children of a depth, over all valid parents of each request.

    ``parent_scores float32[B, P]``, ``child_logprobs float32[B, P, K]`` (the log-probs of each
    parent's K candidates), ``num_parents int32[B]`` (parents ``p >= num_parents[b]`` are
    ignored). A child's score is ``parent_scores[b, p] + child_logprobs[b, p, k]``.

    Returns ``parent_idx int32[B, W]``, ``child_k int32[B, W]`` and ``scores float32[B, W]``,
    best first; ties go to the lower flat index ``p * K + k``; NaN scores rank as -inf. Where a
    request has fewer than W children, the rest is padded with -1, -1 and -inf. ``width >= 1``.
    """
    if validate:
        _validate_select_top_w(parent_scores, child_logprobs, num_parents, width, on_device=_on_device(parent_scores))
    return _ops.select_top_w.default(parent_scores, child_logprobs, num_parents, width)


def select_top_b(parents: torch.Tensor, scores: torch.Tensor, num_nodes: torch.Tensor, budget: int, *,
                 validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prune a tree to its root plus at most ``budget`` nodes, best first.

    Semantics are best-first heap selection: starting from the root, repeatedly keep the best
    node (highest ``scores float32[B, N]``, then lowest index; NaN ranks as -inf) whose parent
    is already kept. The result is therefore always prefix-closed, whatever the scores. When no
    score exceeds its parent's (DARTree with a depth bonus <= 0), the heap's choice is exactly
    the global top-``budget`` of the non-root nodes in that order (DARTree's Lemma 1), and the
    kernels take that fast path; otherwise they run the heap.

    Returns ``keep int32[B, budget + 1]`` (kept node indices in ascending order, so still
    topological, root first, padded with -1), ``new_parents int32[B, budget + 1]`` (parents as
    indices into ``keep``, -1 for the root and padding) and ``num_kept int32[B]`` (root included).
    """
    if validate:
        _validate_select_top_b(parents, scores, num_nodes, budget, on_device=_on_device(parents))
    return _ops.select_top_b.default(parents, scores, num_nodes, budget)


def ddtree_heap(logprobs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor, budget: int, *,
                validate: bool = True) -> tuple[torch.Tensor, ...]:
    """DDTree's best-first draft tree over per-position marginals.

    ``logprobs float32[B, D, K]`` holds, for each of D draft positions, the log-probs of its K
    candidates sorted in descending order (checked), ``token_ids int64[B, D, K]`` their tokens
    and ``root_tokens int64[B]`` the last committed tokens. A node is a prefix of candidate ranks
    (one per depth) scored by the sum of their log-probs. Starting from the first candidate of
    depth 1, pop the best prefix, add it to the tree, push its next sibling and its first child;
    stop after ``budget`` nodes (at most :data:`MAX_HEAP_BUDGET`) or when nothing is left. Ties
    go to the prefix pushed first.

    Returns the tree in pop order (topological): ``tokens int64[B, budget + 1]``,
    ``parents int32``, ``depths int32``, ``scores float32`` (root 0) and ``num_nodes int32[B]``
    (root included); padding has token 0, parent -1, depth -1, score -inf.
    """
    if validate:
        _validate_ddtree_heap(logprobs, token_ids, root_tokens, budget, on_device=_on_device(logprobs))
    return _ops.ddtree_heap.default(logprobs, token_ids, root_tokens, budget)


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


@torch.library.register_fake("dartree_ext::packed_tree_mask")
def _packed_tree_mask_fake(bits, seq_lens, mask_indptr, total_bytes):
    _check_same_device("packed_tree_mask", bits=bits, seq_lens=seq_lens, mask_indptr=mask_indptr)
    return bits.new_empty((total_bytes,), dtype=torch.uint8)


@torch.library.register_fake("dartree_ext::verify_tree")
def _verify_tree_fake(tokens, parents, num_nodes, target_tokens):
    _check_same_device("verify_tree", parents=parents, num_nodes=num_nodes, tokens=tokens,
                       target_tokens=target_tokens)
    batch = parents.shape[0]
    return torch.empty_like(parents), parents.new_empty((batch,)), tokens.new_empty((batch,))


@torch.library.register_fake("dartree_ext::select_top_w")
def _select_top_w_fake(parent_scores, child_logprobs, num_parents, width):
    _check_same_device("select_top_w", parent_scores=parent_scores, child_logprobs=child_logprobs,
                       num_parents=num_parents)
    batch = parent_scores.shape[0]
    return (num_parents.new_empty((batch, width)), num_parents.new_empty((batch, width)),
            parent_scores.new_empty((batch, width)))


@torch.library.register_fake("dartree_ext::select_top_b")
def _select_top_b_fake(parents, scores, num_nodes, budget):
    _check_same_device("select_top_b", parents=parents, scores=scores, num_nodes=num_nodes)
    batch = parents.shape[0]
    return (parents.new_empty((batch, budget + 1)), parents.new_empty((batch, budget + 1)),
            parents.new_empty((batch,)))


@torch.library.register_fake("dartree_ext::ddtree_heap")
def _ddtree_heap_fake(logprobs, token_ids, root_tokens, budget):
    _check_same_device("ddtree_heap", logprobs=logprobs, token_ids=token_ids, root_tokens=root_tokens)
    batch, slots = logprobs.shape[0], budget + 1
    return (token_ids.new_empty((batch, slots)), logprobs.new_empty((batch, slots), dtype=torch.int32),
            logprobs.new_empty((batch, slots), dtype=torch.int32), logprobs.new_empty((batch, slots)),
            logprobs.new_empty((batch,), dtype=torch.int32))


# expand area ---------------------------------------------------------------------------------

def _head_tensors(head) -> tuple:
    return (head.w_s, head.fc2_weight, head.fc2_bias, head.gru_table, head.w_hh, head.b_hh)


def expand_depth(head, z: torch.Tensor, cand_ids: torch.Tensor, cand_base: torch.Tensor,
                 parent_states: torch.Tensor, parent_scores: torch.Tensor, num_parents: torch.Tensor, width: int,
                 depth_bonus: float = -0.2, *, validate: bool = True) -> tuple[torch.Tensor, ...]:
    """One depth of DARTree's expansion with a GRU correction head
    (:class:`dartree_ext.head.CorrectionHeadWeights`).

    For each of the ``num_parents[b]`` parents (``parent_states float32[B, P, G]``,
    ``parent_scores float32[B, P]``): corrected logits of the K candidates
    ``cand_base[b, k] + fc2_weight[cand_ids[b, k]] . SiLU(z[b] + w_s s) (+ fc2_bias)`` (only the
    K rows of fc2 are read), log-softmax over the K, child score = parent score + log q +
    ``depth_bonus``; the ``width`` best children over all parents (ties to the lower flat index
    ``p * K + k``; NaN as -inf), and their GRU states. ``z [B, E]`` and ``cand_base [B, K]`` are
    in the head's dtype; ``cand_ids int64[B, K]``.

    Returns ``parent_idx int32[B, W]``, ``child_k int32[B, W]``, ``scores float32[B, W]``,
    ``tokens int64[B, W]`` and ``states float32[B, W, G]``; missing children (fewer than W) are
    padded with -1, -1, -inf, 0 and zero states. ``validate=True``: candidate ids outside the
    head's vocabulary on CUDA (the CPU op always checks them), NaN in ``cand_base`` or the valid
    parents' scores, raise ``ValueError``.
    """
    if validate:
        _validate_expand_depth(head, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width,
                               on_device=_on_device(cand_ids))
    return _ops.expand_depth.default(z, cand_ids, cand_base, parent_states, parent_scores, num_parents,
                                     *_head_tensors(head), width, depth_bonus)


def build_supertree(head, z: torch.Tensor, cand_ids: torch.Tensor, cand_base: torch.Tensor,
                    root_state: torch.Tensor, width: int | list[int], depth_bonus: float = -0.2, *,
                    validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All D depths of DARTree's expansion in one call (on CUDA: no host synchronization).

    ``z [B, D, E]``, ``cand_ids int64[B, D, K]``, ``cand_base [B, D, K]``, ``root_state [B, G]``
    (head dtype); ``width`` per depth (an int for all). Depth 1 expands the root; depth d + 1
    expands the kept children of depth d.

    Returns depth-major ``tokens int64[B, M]``, ``parents int32[B, M]`` (index into the same M
    nodes, -1 for the root), ``depths int32[B, M]`` (1..D) and ``scores float32[B, M]``, with
    M = the sum of the widths. Where a depth has fewer children than its width, the rest is
    padding: depth -1, parent -1, score -inf, token 0. ``validate=True``: as :func:`expand_depth`.
    """
    if validate:
        _validate_build_supertree(head, z, cand_ids, cand_base, root_state, width, on_device=_on_device(cand_ids))
    return _ops.build_supertree.default(z, cand_ids, cand_base, root_state, *_head_tensors(head),
                                        depth_widths(width, z.shape[1], exact=True),
                                        depth_bonus)


@torch.library.register_fake("dartree_ext::expand_depth")
def _expand_depth_fake(z, cand_ids, cand_base, parent_states, parent_scores, num_parents, w_s, fc2_weight, fc2_bias,
                       gru_table, w_hh, b_hh, width, depth_bonus):
    _check_same_device("expand_depth", z=z, cand_ids=cand_ids, parent_states=parent_states, w_s=w_s)
    batch, g = z.shape[0], w_s.shape[1]
    return (num_parents.new_empty((batch, width)), num_parents.new_empty((batch, width)),
            parent_scores.new_empty((batch, width)), cand_ids.new_empty((batch, width)),
            parent_states.new_empty((batch, width, g)))


@torch.library.register_fake("dartree_ext::build_supertree")
def _build_supertree_fake(z, cand_ids, cand_base, root_state, w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh,
                          widths, depth_bonus):
    _check_same_device("build_supertree", z=z, cand_ids=cand_ids, root_state=root_state, w_s=w_s)
    batch, total = z.shape[0], sum(widths)
    return (cand_ids.new_empty((batch, total)), cand_ids.new_empty((batch, total), dtype=torch.int32),
            cand_ids.new_empty((batch, total), dtype=torch.int32), z.new_empty((batch, total), dtype=torch.float32))


# kv area ---------------------------------------------------------------------------------------

def compact_kv_(keys: torch.Tensor, values: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor,
                lengths: torch.Tensor) -> None:
    """Compact one layer's KV cache in place after verification.

    ``keys [B, H, S, Dk]`` and ``values [B, H, S, Dv]`` (transformers' layout, any dtype, one for
    both, contiguous). For each request ``b``, the entries at ``src_positions[b, :lengths[b]]``
    (int64, increasing, at or after ``dst_start[b]``: the accepted tree nodes' cache slots) move
    to ``dst_start[b] + i`` (int64; typically the request's committed length), for every head.
    Entries past the moved ones are left as they are (the caller's attention mask hides them).
    The CPU op checks the positions (``ValueError``); the CUDA kernel stages each row before
    writing, so it is correct for any order, and skips positions outside the cache. ``keys`` and
    ``values`` must agree on batch, heads and sequence length (their head dims may differ).
    """
    _ops.compact_kv_.default(keys, values, src_positions, dst_start, lengths)


def compact_kv_layers_(caches: list[torch.Tensor], src_positions: torch.Tensor, dst_start: torch.Tensor,
                       lengths: torch.Tensor) -> None:
    """:func:`compact_kv_` for every layer in one call (one launch on CUDA, per 64 tensors).

    ``caches``: tensors ``[B, H, S, D]`` (every layer's keys and values; any dtypes, contiguous,
    the same ``B`` and ``S``; heads and head dims may differ). The moves are :func:`compact_kv_`'s
    and the same for every tensor. The CPU op checks the positions before moving anything
    (``ValueError``, caches untouched); the CUDA kernel skips positions outside the cache."""
    _ops.compact_kv_layers_.default(list(caches), src_positions, dst_start, lengths)


@torch.library.register_fake("dartree_ext::compact_kv_layers_")
def _compact_kv_layers_fake(caches, src_positions, dst_start, lengths):
    _check_same_device("compact_kv_layers_", src_positions=src_positions, dst_start=dst_start, lengths=lengths,
                       **{f"caches[{i}]": c for i, c in enumerate(caches)})
    return None


def compact_kv_paged_(caches: list[torch.Tensor], block_table: torch.Tensor, src_positions: torch.Tensor,
                      dst_start: torch.Tensor, lengths: torch.Tensor, *, validate: bool = True) -> None:
    """:func:`compact_kv_` for paged caches, every layer in one call (one launch on CUDA).

    ``caches``: pools ``[num_pages, page_size, ...]`` (keys and values of every layer, any dtype,
    contiguous, the same ``num_pages`` and ``page_size``; vLLM / SGLang / FlashInfer's NHD page
    layout). Request ``b``'s logical position ``p`` is slot ``p % page_size`` of page
    ``block_table[b, p // page_size]`` (int32 ``[B, max_pages]``). For each request the entries at
    logical ``src_positions[b, :lengths[b]]`` (increasing, at or after ``dst_start[b]``) move to
    logical ``dst_start[b] + i``, in every pool. The CPU op checks every value before moving
    anything (``ValueError``, pools untouched): pages inside the pool, a request's touched pages
    distinct, no slot written by two requests or written by one and read by another. CUDA checks
    dtypes, shapes and devices only, unless ``validate=True`` (the CPU op's checks on a host copy of
    the indices); its kernel skips a move whose position or page lies outside the table or the pool."""
    if validate:
        _validate_compact_kv_paged(caches, block_table, src_positions, dst_start, lengths,
                                   on_device=_on_device(block_table))
    _ops.compact_kv_paged_.default(list(caches), block_table, src_positions, dst_start, lengths)


@torch.library.register_fake("dartree_ext::compact_kv_paged_")
def _compact_kv_paged_fake(caches, block_table, src_positions, dst_start, lengths):
    _check_same_device("compact_kv_paged_", block_table=block_table, src_positions=src_positions,
                       dst_start=dst_start, lengths=lengths, **{f"caches[{i}]": c for i, c in enumerate(caches)})
    return None


@torch.library.register_fake("dartree_ext::few_rows_linear")
def _few_rows_linear_fake(x, weight, bias):
    _check_same_device("few_rows_linear", x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("dartree_ext::quant_linear")
def _quant_linear_fake(x, blocks, kind, bias):
    _check_same_device("quant_linear", x=x, blocks=blocks, **({} if bias is None else {"bias": bias}))
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


for _name in ("quant_linear_portable", "quant_linear_int8", "quant_linear_int8_portable"):
    torch.library.register_fake(f"dartree_ext::{_name}")(_quant_linear_fake)


@torch.library.register_fake("dartree_ext::amx_linear")
def _amx_linear_fake(x, packed, out_features, bias):
    _check_same_device("amx_linear", x=x, packed=packed, **({} if bias is None else {"bias": bias}))
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("dartree_ext::few_rows_attention")
def _few_rows_attention_fake(query, key, value, mask, scale):
    _check_same_device("few_rows_attention", query=query, key=key, value=value,
                       **({} if mask is None else {"mask": mask}))
    return query.new_empty((*query.shape[:3], value.shape[-1]))


@torch.library.register_fake("dartree_ext::rms_norm_rows")
def _rms_norm_rows_fake(x, weight, eps):
    _check_same_device("rms_norm_rows", x=x, weight=weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("dartree_ext::rotary_rows")
def _rotary_rows_fake(x, positions, theta):
    _check_same_device("rotary_rows", x=x, positions=positions)
    return x.new_empty(x.shape)


@torch.library.register_fake("dartree_ext::rotary_tables")
def _rotary_tables_fake(q, k, cos, sin):
    _check_same_device("rotary_tables", q=q, k=k, cos=cos, sin=sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("dartree_ext::silu_mul")
def _silu_mul_fake(gate, up):
    _check_same_device("silu_mul", gate=gate, up=up)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("dartree_ext::silu_mul_build")  # tests: silu_mul through one build
def _silu_mul_build_fake(gate, up, build):
    return _silu_mul_fake(gate, up)


@torch.library.register_fake("dartree_ext::tokens_from_logits")
def _tokens_from_logits_fake(logits, uniforms, temperature):
    _check_same_device("tokens_from_logits", logits=logits, **({} if uniforms is None else {"uniforms": uniforms}))
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


# the ops that force one path of few_rows_linear (tests, bench/analysis/forward_speed.py): the same shapes
for _path in ("portable", "avx2", "avx512", "avx512_bf16"):
    torch.library.register_fake(f"dartree_ext::few_rows_linear_{_path}")(_few_rows_linear_fake)


@torch.library.register_fake("dartree_ext::compact_kv_")
def _compact_kv_fake(keys, values, src_positions, dst_start, lengths):
    _check_same_device("compact_kv_", keys=keys, values=values, src_positions=src_positions, dst_start=dst_start,
                       lengths=lengths)
    return None
