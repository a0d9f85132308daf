"""A target's linear layers run on the GGUF's own 4-bit / 8-bit blocks (:func:`ops.quant_linear`).

Block layouts (ggml's, 32 weights a block, little-endian; a weight row is ``K / 32`` blocks):

* ``q4_0``: fp16 ``d``, 16 bytes of nibbles: ``w[i] = d * (q[i] - 8)`` (18 bytes);
* ``q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles: ``w[i] = d * q[i] + m`` (20 bytes);
* ``q8_0``: fp16 ``d``, 32 int8: ``w[i] = d * q[i]`` (34 bytes);

the low nibble of byte ``j`` is ``q[j]``, its high nibble ``q[j + 16]``. :func:`dequantize` is the
pure-PyTorch definition (float32, exactly the values ``transformers`` gives the same file), and
:func:`quantize` ggml's reference rounding, for tests and for weights that come as floats.

    from dartree_ext.quant import use_gguf_linear
    use_gguf_linear(target, gguf_path)   # the linears found in the GGUF: quant_linear for <= 65 rows

The layers keep their dense weights (a prefill, autograd, other devices and the drafter's head
over the target's embeddings use them); a patched step reads only the blocks: for SmolLM2-135M
Q4_1 about 94 MB a token instead of 270 MB in bfloat16.
"""
from __future__ import annotations

import types

import numpy as np
import torch
import torch.nn.functional as F

from . import ops

BLOCK = 32
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
KINDS = tuple(BLOCK_BYTES)
_FLAG = "_dartree_quant"


def _check_kind(kind: str, op: str = "quant") -> int:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{op}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return BLOCK_BYTES[kind]


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """``blocks uint8[N, K / 32 * bytes]`` as float32 ``[N, K]`` (the layouts above)."""
    size = _check_kind(kind, "dequantize")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"blocks must be uint8 [N, a multiple of {size}] for {kind}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, blocks, 1]
    if kind == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    qs = b[..., 4:] if kind == "q4_1" else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, blocks, 32]: low nibbles, then high
    if kind == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        w = torch.addcmul(m, q, d)  # d * q is exact; the one rounding is the sum (a fused multiply-add's)
    else:
        w = d * (q - 8)
    return w.reshape(n, -1)


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight [N, K]`` (K a multiple of 32) in ``kind``'s blocks, rounded as ggml's reference
    quantizers round (q4_0: ``d = max / -8`` of the largest-magnitude value; q4_1: ``d = (max - min)
    / 15``, ``m = min``; q8_0: ``d = amax / 127``)."""
    size = _check_kind(kind, "quantize")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"weight must be [N, a multiple of {BLOCK}], got {tuple(weight.shape)}")
    n = weight.shape[0]
    w = weight.detach().float().reshape(n, -1, BLOCK)
    out = torch.empty(n, w.shape[1], size, dtype=torch.uint8)
    if kind == "q8_0":
        d = w.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, w / d, 0).round().clamp(-128, 127).to(torch.int8)
        out[..., 0:2] = d.half().view(torch.uint8)
        out[..., 2:] = q.view(torch.uint8)
        return out.reshape(n, -1)
    if kind == "q4_1":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.where(d > 0, (w - lo) / d, 0).add(0.5).floor().clamp(0, 15).to(torch.uint8)
        out[..., 0:2] = d.half().view(torch.uint8)
        out[..., 2:4] = lo.half().view(torch.uint8)
        first = 4
    else:
        big = w.gather(-1, w.abs().argmax(-1, keepdim=True))
        d = big / -8
        q = torch.where(d != 0, w / d, 0).add(8.5).floor().clamp(0, 15).to(torch.uint8)
        out[..., 0:2] = d.half().view(torch.uint8)
        first = 2
    out[..., first:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, -1)


def pack_int8(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """``blocks`` (GGUF layout) rearranged for :func:`ops.quant_linear_int8`: each row's blocks in
    groups of 16 (the last holds the rest, ``L``), a group ``[L fp16 d][L fp16 m: q4_1][codes]`` with
    the codes as 4-byte words word-major (word ``g`` of block ``l`` at byte ``4 (g L + l)``). The
    same bytes, the same shape."""
    size = _check_kind(kind, "pack_int8")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"blocks must be uint8 [N, a multiple of {size}] for {kind}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    n, nb = blocks.shape[0], blocks.shape[1] // size
    b = blocks.reshape(n, nb, size)
    first = 4 if kind == "q4_1" else 2
    parts = []
    for start in range(0, nb, 16):
        g = b[:, start:start + 16]
        count = g.shape[1]
        parts.append(g[..., 0:2].reshape(n, 2 * count))
        if kind == "q4_1":
            parts.append(g[..., 2:4].reshape(n, 2 * count))
        parts.append(g[..., first:].reshape(n, count, -1, 4).transpose(1, 2).reshape(n, -1))
    return torch.cat(parts, 1).contiguous()


# ---- sibling layers in one buffer ---------------------------------------------------------------

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers that read the same input


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` (2D, one row width) as one tensor of their rows without a copy, where they are
    consecutive rows of one buffer (as :func:`gguf_linears` and :func:`use_quant_linear` lay out
    :data:`SIBLINGS`); else ``None``."""
    first = parts[0]
    width = first.shape[-1] if first.dim() == 2 else -1
    for a, b in zip(parts, parts[1:]):
        if not (b.dim() == 2 and b.shape[1] == width and b.dtype == a.dtype and a.is_contiguous() and b.is_contiguous()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()):
            return None
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, width), (width, 1))


def _join_siblings(layers: dict[str, tuple[str, torch.Tensor]], transform=None) -> dict[str, tuple[str, torch.Tensor]]:
    """``layers`` with each :data:`SIBLINGS` group of one module (all present, one kind, one row
    width) as views of one buffer of their rows, so that one call of a block op can run the group
    (``transform(blocks, kind)``, a row-wise repacking such as :func:`pack_int8`, applied to the
    buffer; to the other layers' blocks alone)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, (kind, blocks) in layers.items():
        if name in out:
            continue
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in SIBLINGS if leaf in g), ())
        names = [f"{parent}.{n}" if parent else n for n in group]
        parts = [layers[n][1] for n in names if n in layers]
        if (len(parts) == len(names) > 1 and {layers[n][0] for n in names} == {kind}
                and len({p.shape[1] for p in parts}) == 1):
            joined = joined_rows(parts)
            joined = torch.cat(parts) if joined is None else joined
            joined = joined if transform is None else transform(joined, kind)
            out.update((n, (kind, view)) for n, view in zip(names, joined.split([p.shape[0] for p in parts])))
        else:
            out[name] = (kind, blocks if transform is None else transform(blocks, kind))
    return out


# ---- GGUF files -------------------------------------------------------------------------------

_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order ``transformers`` gives a llama GGUF's q/k weights (the converter interleaves
    each head's rotary halves; loading undoes it): a permutation of whole rows."""
    index = torch.arange(rows)
    half = rows // heads // 2
    return index.reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def gguf_linears(path: str, config) -> dict[str, tuple[str, torch.Tensor]]:
    """The linear layers of a llama-architecture GGUF kept in their blocks: ``{module name:
    (kind, uint8 blocks [out, bytes])}`` under the HF module names (``model.layers.3.mlp.up_proj``,
    ``lm_head``: the output matrix, or the token embedding when the file ties them). Tensors of
    other types (F16, K-quants) are left out: those layers keep their dense weights."""
    import gguf
    reader = gguf.GGUFReader(path)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name.lower()
        if kind not in BLOCK_BYTES:
            continue
        parts = tensor.name.split(".")
        if tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and "lm_head" not in found):
            name = "lm_head"
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_TO_HF:
            name = f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}"
        else:
            continue
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        blocks = blocks.reshape(int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1, -1)
        if parts[-2:-1] in (["attn_q"], ["attn_k"]):
            blocks = blocks[_unpermute_rows(blocks.shape[0], heads if parts[2] == "attn_q" else kv_heads)]
        found[name] = (kind, blocks.contiguous())
    return _join_siblings(found)


# ---- a model's layers --------------------------------------------------------------------------

def _quant_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    kind, blocks, max_rows, int8 = getattr(self, _FLAG)
    weight, bias = self.weight, self.bias
    if (x.is_cpu and (x.dtype is torch.float32 or x.dtype is torch.bfloat16) and 0 < x.numel() <= max_rows * x.shape[-1]
            and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        return (ops.quant_linear_int8 if int8 else ops.quant_linear)(x, blocks, kind, bias)
    return F.linear(x, weight, bias)


def use_quant_linear(model: torch.nn.Module, layers: dict[str, tuple[str, torch.Tensor]], max_rows: int = 65,
                     int8: bool = False) -> int:
    """Route the named ``nn.Linear`` layers of ``model`` through :func:`ops.quant_linear` (with
    ``int8``: :func:`ops.quant_linear_int8`, activations rounded to 8 bits) on their blocks for
    inputs of at most ``max_rows`` rows (``layers``: as :func:`gguf_linears` gives). Each block
    matrix must de-quantize to the layer's shape. Returns how many were patched."""
    modules = dict(model.named_modules())
    count = 0
    for name, (kind, blocks) in layers.items():
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(f"use_quant_linear: {name}'s blocks must be a uint8 [out, bytes] tensor")
    layers = _join_siblings(layers, pack_int8 if int8 else None)
    for name, (kind, blocks) in layers.items():
        layer = modules.get(name)
        if not isinstance(layer, torch.nn.Linear):
            raise ValueError(f"use_quant_linear: {name} is not an nn.Linear of the model")
        size = _check_kind(kind)
        shape = (blocks.shape[0], blocks.shape[1] // size * BLOCK)
        if shape != tuple(layer.weight.shape):
            raise ValueError(f"use_quant_linear: {name}'s {kind} blocks hold {shape}, the layer {tuple(layer.weight.shape)}")
        setattr(layer, _FLAG, (kind, blocks, int(max_rows), bool(int8)))
        layer.forward = types.MethodType(_quant_forward, layer)
        count += 1
    return count


def restore_quant_linear(model: torch.nn.Module) -> int:
    """Undo :func:`use_quant_linear` (the layers go back to ``F.linear``, or to ``few_rows_linear``
    when :func:`dartree_ext.linear.set_linear` patched them first)."""
    from .linear import _FLAG as FEW_ROWS, _few_rows_forward
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, _FLAG):
            delattr(module, _FLAG)
            if hasattr(module, FEW_ROWS):
                module.forward = types.MethodType(_few_rows_forward, module)
            elif "forward" in module.__dict__:
                del module.forward
            count += 1
    return count


def int8_activations(model: torch.nn.Module) -> bool:
    """Whether ``model``'s block-patched layers round their inputs to 8 bits (``quant_linear_int8``)."""
    return any(getattr(m, _FLAG)[3] for m in model.modules() if hasattr(m, _FLAG))


def layer_blocks(module: torch.nn.Module) -> tuple[str, torch.Tensor] | None:
    """``(kind, blocks)`` a layer patched by :func:`use_quant_linear` runs on (the blocks as the op
    reads them: repacked for the int8 path), or ``None`` for any other module."""
    flag = getattr(module, _FLAG, None)
    return None if flag is None else (flag[0], flag[1])


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of blocks a patched step reads (the patched layers' blocks)."""
    return sum(getattr(m, _FLAG)[1].numel() for m in model.modules() if hasattr(m, _FLAG))


_SOURCE = "_dartree_gguf"


class _Source:
    """A model's GGUF and its blocks, read on first use; copies of the model share it (the blocks
    are read-only)."""

    def __init__(self, path: str) -> None:
        self.path, self.layers = path, None

    def __deepcopy__(self, memo):
        return self


def attach_gguf(model: torch.nn.Module, path: str) -> None:
    """Record that ``model``'s weights came from the GGUF at ``path`` (its loader calls this), so
    ``set_linear(model, "gguf")`` can read the blocks (once; copies of the model share them)."""
    setattr(model, _SOURCE, _Source(path))


def gguf_source(model: torch.nn.Module) -> str | None:
    """The GGUF ``model`` was loaded from (:func:`attach_gguf`), or ``None``."""
    source = getattr(model, _SOURCE, None)
    return source.path if source else None


def use_gguf_layers(model: torch.nn.Module, max_rows: int = 65, int8: bool = False) -> int:
    """:func:`use_quant_linear` with every layer the model's GGUF (:func:`attach_gguf`) holds in
    blocks of a kind :func:`ops.quant_linear` runs."""
    source = getattr(model, _SOURCE, None)
    if not source:
        raise ValueError("linear 'gguf' needs a model loaded from a GGUF (dartree_ext.quant.attach_gguf); "
                         "this one was not")
    if source.layers is None:
        source.layers = gguf_linears(source.path, model.config)
    return use_quant_linear(model, source.layers, max_rows, int8)


def use_gguf_linear(model: torch.nn.Module, path: str, max_rows: int = 65) -> int:
    """:func:`attach_gguf` and :func:`use_gguf_layers` in one call."""
    attach_gguf(model, path)
    return use_gguf_layers(model, max_rows)
