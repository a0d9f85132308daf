"""A model's linear layers through :func:`dartree_ext.ops.few_rows_linear` for small inputs.

On a CPU a verification forward runs every linear layer of the target over root + tree rows (a
few dozen at most). A library GEMM packs the weight matrix on every call once there is more than
one row, so its time grows with the rows long before the arithmetic does; ``few_rows_linear``
reads each weight row once and dots it with all the rows. Whether that is faster depends on the
CPU: :func:`dartree_ext.decoding.profiling.choose_forward` measures it (with the dtype) and the CLIs
use what it picks.

    from dartree_ext.linear import use_few_rows_linear
    use_few_rows_linear(target)         # every nn.Linear: few_rows_linear for <= 65 rows on the CPU
    restore_torch_linear(target)        # back to torch.nn.functional.linear

:func:`dartree_ext.loading.load_drafter` gives a drafter the target's set-up (its layers and its
head over a draft vocabulary), so the drafter pass of a round gains as the verification does.

Patched layers keep ``torch.nn.functional.linear`` for larger inputs (a prefill), other devices
and dtypes, non-contiguous weights, and whenever autograd needs the graph. A patched model's
outputs differ from an unpatched one's by rounding only; plain decoding and speculative decoding
with the same patched model are compared like for like.
"""
from __future__ import annotations

import functools

import types

import torch
import torch.nn.functional as F

from . import ops

DEFAULT_MAX_ROWS = 65  # a 64-node tree and its root
LINEAR_KINDS = ("torch", "few_rows", "amx", "gguf", "gguf_int8")  # how a model's linear layers run (set_linear)
_FLAG = "_dartree_few_rows"
_AMX = "_dartree_amx"  # on a layer running amx_linear: its packed weight, the layer's weight, its version


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> bool:
    """Whether ``few_rows_linear`` takes this call: CPU, float32 / bfloat16 like the weight, at most
    ``max_rows`` rows, a contiguous weight, and no autograd graph wanted. (Every linear call of a
    patched model runs this: plain attribute reads, a few microseconds in all.)"""
    dtype = x.dtype
    return (x.is_cpu and dtype == weight.dtype and (dtype is torch.bfloat16 or dtype is torch.float32)
            and x.dim() >= 1 and 0 < x.numel() <= max_rows * x.shape[-1] and weight.is_contiguous()
            and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def _few_rows_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if _fits(x, weight, bias, getattr(self, _FLAG)):
        return ops.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=None)
def amx_available() -> bool:
    """Whether this process can run :func:`dartree_ext.ops.amx_linear` (AMX-BF16, granted the tile
    state; asked once a process)."""
    from ._C import build_info
    return build_info().get("amx_linear") == "amx_bf16"


def _amx_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if x.dtype is torch.bfloat16 and _fits(x, weight, bias, getattr(self, _FLAG)):
        packed, source, version = getattr(self, _AMX)
        if source is not weight or version != weight._version:  # the weight was replaced or written to
            packed, version = ops.pack_amx(weight), weight._version
            setattr(self, _AMX, (packed, weight, version))
        return ops.amx_linear(x, packed, weight.shape[0], bias)
    return F.linear(x, weight, bias)


def _amx_fits(module: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` with a contiguous bfloat16 weight (not an inference tensor: its packed
    copy follows the weight's version) whose input size is a multiple of 32."""
    if not _plain_linear(module):
        return False
    w = module.weight
    return (w.dtype is torch.bfloat16 and w.dim() == 2 and w.shape[1] % 32 == 0 and w.is_contiguous()
            and not w.is_inference() and w.device.type == "cpu")


def use_amx_linear(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Route every plain bfloat16 ``nn.Linear`` of ``model`` whose input size is a multiple of 32
    through :func:`dartree_ext.ops.amx_linear` (AMX tiles, batch-invariant) for inputs of at most
    ``max_rows`` rows, each over a packed copy of its weight (as many bytes again as the layers'
    weights; re-packed if a weight changes). Other layers keep ``few_rows_linear``. Returns how many
    layers were patched (0 without AMX)."""
    if not amx_available():
        return 0
    use_few_rows_linear(model, max_rows)
    count = 0
    for module in model.modules():
        if _amx_fits(module):
            weight = module.weight
            setattr(module, _AMX, (ops.pack_amx(weight), weight, weight._version))
            module.forward = types.MethodType(_amx_forward, module)
            count += 1
    return count


def restore_few_rows_linear(model: torch.nn.Module) -> int:
    """Undo :func:`use_amx_linear` (the layers go back to ``few_rows_linear``). Returns how many
    layers were restored."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, _AMX):
            delattr(module, _AMX)
            module.forward = types.MethodType(_few_rows_forward, module)
            count += 1
    return count


def linear_as(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None, fallback=None) -> torch.Tensor:
    """``x @ weight.T + bias`` run the way ``layer`` (an ``nn.Linear``) runs: through
    ``few_rows_linear`` when ``layer`` is patched and the call qualifies, else ``F.linear`` (or
    ``fallback()``, when given). For a product a model computes outside its ``nn.Linear`` layers (a
    drafter's head over a draft vocabulary) that should follow the model's linear set-up."""
    max_rows = getattr(layer, _FLAG, None)
    if max_rows is not None and _fits(x, weight, bias, max_rows):
        return ops.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias) if fallback is None else fallback()


def _plain_linear(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``nn.Linear``'s own (not a quantized subclass, not a hooked
    instance): only those are patched, since the fallback is ``F.linear``."""
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and ("forward" not in module.__dict__ or hasattr(module, _FLAG) or hasattr(module, _AMX)))


def use_few_rows_linear(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through ``few_rows_linear`` for inputs of at
    most ``max_rows`` rows (1..256). Subclasses with their own forward (quantized layers) and
    layers whose instance forward is already replaced (hooks) are left alone. Returns how many
    layers were patched; calling it again updates ``max_rows``. A patched model pickles only after
    :func:`restore_torch_linear`."""
    if not 1 <= max_rows <= 256:
        raise ValueError(f"max_rows must be in [1, 256], got {max_rows}")
    count = 0
    for module in model.modules():
        if _plain_linear(module):
            setattr(module, _FLAG, int(max_rows))
            module.forward = types.MethodType(_few_rows_forward, module)
            count += 1
    return count


def restore_torch_linear(model: torch.nn.Module) -> int:
    """Undo :func:`use_few_rows_linear`. Returns how many layers were restored."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, _FLAG):
            delattr(module, _FLAG)
            if hasattr(module, _AMX):
                delattr(module, _AMX)
            if "forward" in module.__dict__:
                del module.forward
            count += 1
    return count


def linear_kind(model: torch.nn.Module) -> str:
    """``"gguf"`` when ``model``'s linear layers read a GGUF's blocks (``"gguf_int8"`` with their
    inputs rounded to 8 bits), ``"amx"`` when they run ``amx_linear``, ``"few_rows"`` when they are
    patched with ``few_rows_linear`` alone, else ``"torch"``."""
    from .quant import _FLAG as QUANT
    modules = list(model.modules())  # one walk (cost_key asks per decode)
    linears = [m for m in modules if isinstance(m, torch.nn.Linear) and hasattr(m, _FLAG)]
    if not linears:
        return "torch"
    quantized = [getattr(m, QUANT) for m in modules if hasattr(m, QUANT)]
    if not any(flag[1].numel() for flag in quantized):  # quant.quantized_bytes(model) == 0
        return "amx" if any(hasattr(m, _AMX) for m in linears) else "few_rows"
    return "gguf_int8" if any(flag[3] for flag in quantized) else "gguf"  # quant.int8_activations(model)


def linear_kinds(model: torch.nn.Module, auto: bool = False) -> tuple[str, ...]:
    """The kinds ``model`` can run: ``"gguf"`` and ``"gguf_int8"`` only for a model loaded from a
    GGUF (:func:`dartree_ext.quant.attach_gguf`), ``"amx"`` only where :func:`amx_available` (and
    for bfloat16 weights: :func:`set_linear` refuses others). ``auto=True``: the ones ``--linear auto``
    measures (``"gguf_int8"`` is asked for by name: it rounds the layers' inputs to 8 bits)."""
    from .quant import gguf_source
    kinds = LINEAR_KINDS if gguf_source(model) else tuple(k for k in LINEAR_KINDS if not k.startswith("gguf"))
    if not amx_available():
        kinds = tuple(k for k in kinds if k != "amx")
    return tuple(k for k in kinds if k != "gguf_int8") if auto else kinds


def few_rows_max_rows(model: torch.nn.Module) -> int | None:
    """The ``max_rows`` of ``model``'s patched layers (``None`` when none is patched)."""
    return next((getattr(m, _FLAG) for m in model.modules() if hasattr(m, _FLAG)), None)


def set_linear(model: torch.nn.Module, kind: str, max_rows: int = DEFAULT_MAX_ROWS) -> None:
    """``kind`` = ``"few_rows"``, ``"amx"``, ``"gguf"`` or ``"torch"``: patch or restore ``model``'s
    linear layers, and with them its RMSNorms, rotary embedding and SwiGLU activations
    (:mod:`dartree_ext.row_layers`: per-row CPU ops for a forward's small steps). ``"amx"`` is
    ``"few_rows"`` with the bfloat16 layers through ``amx_linear`` (:func:`use_amx_linear`; a
    ``ValueError`` without AMX or for a model with no bfloat16 layer it takes). ``"gguf"`` is
    ``"few_rows"`` with the layers the model's GGUF holds in 4-/8-bit blocks reading those blocks
    (:func:`dartree_ext.quant.use_gguf_layers`; a model loaded from a GGUF only), ``"gguf_int8"``
    the same with the layers' inputs rounded to 8 bits (``quant_linear_int8``)."""
    from .quant import restore_quant_linear, use_gguf_layers
    from .row_layers import restore_row_layers, use_row_layers
    if kind not in LINEAR_KINDS:
        raise ValueError(f"linear must be one of {', '.join(LINEAR_KINDS)}, got {kind!r}")
    if kind == "amx" and not amx_available():
        raise ValueError("linear 'amx' needs AMX-BF16 tiles, which this CPU (or build, or kernel) does not give "
                         "(build_info()['amx_linear'])")
    if kind == "amx" and not any(_amx_fits(m) for m in model.modules()):
        raise ValueError("linear 'amx' needs bfloat16 nn.Linear layers with inputs a multiple of 32; this model's "
                         f"parameters are {next(model.parameters()).dtype}")
    restore_quant_linear(model)
    restore_few_rows_linear(model)
    if kind != "torch":
        use_few_rows_linear(model, max_rows)
        use_row_layers(model)
        if kind == "amx":
            use_amx_linear(model, max_rows)
        if kind.startswith("gguf"):
            use_gguf_layers(model, max_rows, int8=kind == "gguf_int8")
    else:
        restore_torch_linear(model)
        restore_row_layers(model)
