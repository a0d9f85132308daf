"""The attention of a target's forward over a few query rows: on a CPU the row-invariant kernel
:func:`dartree_ext.ops.few_rows_attention` (a tree verification rounds exactly as plain steps do),
elsewhere grouped-query SDPA without copying the keys and values.

A verification forward attends root + tree (a few dozen query rows) to the whole KV cache under a
tree mask. With a mask, transformers' SDPA attention repeats every key/value head for the query
heads that share it (``repeat_kv``: a copy of the layer's cache, every layer, every round), and
the copy grows with the context. :func:`gqa_attention` instead stacks the query heads of each
key/value head as extra query rows: queries ``[B, H, T, D]`` become ``[B, H_kv, (H / H_kv) * T, D]``,
the mask's rows are tiled to match, and one SDPA call runs on the cache as it is. Every output row
is the same attention as before; only the rounding of the kernel's blocking can differ.
(Transformers does this for one query row, ``pack_gqa``; this extends it to a tree.)

    from dartree_ext.attention import use_packed_attention
    use_packed_attention(target)     # an SDPA model: forwards of <= 128 new tokens use gqa_attention
    restore_sdpa_attention(target)

:func:`dartree_ext.loading.load_target` applies it to the targets it loads. A forward over more
than ``MAX_PACKED_ROWS`` new tokens (a prefill), a mask that differs per head, dropout, or a
position bias take transformers' own SDPA attention.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

NAME = "dartree_sdpa"
MAX_PACKED_ROWS = 128  # query rows per forward above which transformers' SDPA attention runs
# CPU: masked forwards of at most MAX_PACKED_ROWS rows run dartree_ext.ops.few_rows_attention (row-
# invariant: a tree verification rounds like a plain step); DARTREE_FEW_ROWS_ATTENTION=0 turns it off
USE_FEW_ROWS_KERNEL = os.environ.get("DARTREE_FEW_ROWS_ATTENTION", "1") != "0"


def gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per query head, query head ``h`` reading key/value head
    ``h // (H / H_kv)``: ``query [B, H, T, D]``, ``key``/``value [B, H_kv, S, D]``, ``mask`` additive
    (float) or bool (True = visible), broadcastable to ``[B, 1, T, S]``. Returns ``[B, H, T, D]``
    without repeating the keys and values."""
    if query.dim() != 4 or key.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"query [B, H, T, D] and key/value [B, H_kv, S, D] expected, got {list(query.shape)}, "
                         f"{list(key.shape)}, {list(value.shape)}")
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split over {kv_heads} key/value heads")
    rep = heads // kv_heads
    if rep == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"mask must be [B, 1, T, S] (one mask for every head), got {list(mask.shape)}")
        if mask.shape[2] != 1:  # row r * T + t of a packed group is query t of that group's head r
            mask = _tiled(mask, rep)
    packed = query.reshape(b, kv_heads, rep * t, d)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, t, out.shape[-1])


_last_tiled: tuple = (None, -1, 0, None)  # (mask, its version, rep, tiled): every layer of a forward shares it


def _tiled(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """``mask`` with its rows repeated ``rep`` times (``[B, 1, rep * T, S]``), built once for all the
    layers of a forward that pass the same, unchanged mask."""
    global _last_tiled
    if torch.compiler.is_compiling():  # traced: the compiler shares the copy itself, no cache
        return torch.cat([mask] * rep, 2)
    src, version, r, tiled = _last_tiled  # one tuple, replaced whole: safe to read from any thread
    if src is mask and version == mask._version and r == rep:
        return tiled
    tiled = torch.cat([mask] * rep, 2)
    _last_tiled = (mask, mask._version, rep, tiled)
    return tiled


def _packable(module, query: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs: dict,
              grouped: bool = True) -> bool:
    """A masked forward of at most ``MAX_PACKED_ROWS`` new tokens with nothing SDPA-specific
    (dropout, a position bias, a soft cap, attention weights); ``grouped``: and grouped-query."""
    return (mask is not None and query.shape[2] <= MAX_PACKED_ROWS and mask.dim() == 4 and mask.shape[1] == 1
            and not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)
            and (not grouped or getattr(module, "num_key_value_groups", 1) > 1))


def few_rows_kernel_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`dartree_ext.ops.few_rows_attention` takes this call: CPU, float32 or
    bfloat16 throughout, at most ``MAX_PACKED_ROWS`` query rows, no gradient, head sizes and
    grouping it supports, an additive floating-point mask of one row per query or none."""
    if not (USE_FEW_ROWS_KERNEL and query.device.type == "cpu" and query.dim() == 4 and key.dim() == 4
            and query.shape[2] <= MAX_PACKED_ROWS and query.dtype in (torch.float32, torch.bfloat16)
            and key.dtype == query.dtype and value.dtype == query.dtype):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    if (kv_heads == 0 or heads % kv_heads or heads // kv_heads > 16 or not 1 <= query.shape[-1] <= 256
            or not 1 <= value.shape[-1] <= 256 or key.shape[2] == 0):
        return False
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if (key.shape[0] != query.shape[0] or value.shape[:3] != key.shape[:3] or key.shape[-1] != query.shape[-1]
            or key.device.type != "cpu" or value.device.type != "cpu"):
        return False
    # float16's minimum (-65504) would not hide a key (the kernel hides at <= -1e30)
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.device.type == "cpu"
                            and mask.dtype in (torch.float32, torch.bfloat16, torch.float64)
                            and mask.shape[3] == key.shape[2] and mask.shape[2] in (1, query.shape[2])
                            and mask.shape[0] in (1, query.shape[0]))


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    """Transformers' attention-interface signature: the row-invariant CPU kernel or
    ``gqa_attention`` where they apply, else SDPA's."""
    if _packable(module, query, attention_mask, dropout, kwargs, grouped=False):
        mask = attention_mask
        if mask.shape[-1] != key.shape[-2]:  # as transformers' SDPA path slices a longer mask
            mask = mask[:, :, :, :key.shape[-2]]
        if few_rows_kernel_fits(query, key, value, mask):
            from . import ops
            out = ops.few_rows_attention(query, key, value, mask, scaling)
            return out.transpose(1, 2).contiguous(), None
        if getattr(module, "num_key_value_groups", 1) > 1:
            out = gqa_attention(query, key, value, mask, scaling)
            return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, _hf_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks transformers builds: SDPA's


def attention_kind(model: torch.nn.Module) -> str:
    """The attention implementation named in ``model``'s config (``"sdpa"``, ``"dartree_sdpa"``, ...)."""
    return getattr(model.config, "_attn_implementation", None) or "eager"


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model from SDPA attention to :func:`gqa_attention` for forwards of at
    most ``MAX_PACKED_ROWS`` new tokens with a mask. Models on another implementation (eager,
    flash, ...) are left alone. Returns whether the model runs it now."""
    kind = attention_kind(model)
    if kind == NAME:
        return True
    if kind != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return attention_kind(model) == NAME


def restore_sdpa_attention(model: torch.nn.Module) -> None:
    """Undo :func:`use_packed_attention`."""
    if attention_kind(model) == NAME:
        model.set_attn_implementation("sdpa")
