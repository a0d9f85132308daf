"""A transformers model's RMSNorm layers, rotary embedding and SwiGLU activation through this
library's per-row CPU ops, one call each instead of the seven, fourteen and two ATen calls of their
PyTorch forms.

A decoding step of a small model on a CPU spends much of its forward outside the matrix products:
SmolLM2-135M's 61 RMSNorms and 30 rotary embeddings made about 800 of its ~1800 ATen calls a
forward. :func:`use_row_layers` routes

- every RMSNorm whose ``forward`` is transformers' ``LlamaRMSNorm.forward`` (Llama, SmolLM2 and
  the architectures that copy it) through :func:`dartree_ext.ops.rms_norm_rows` (float32 math, the
  normalized row and the product rounded to the dtype where the PyTorch form rounds them; its
  float32 sum of squares runs in another order, so a float32 value can differ by a few units in
  the last place, a bfloat16 one rarely by one),
- the modeling module's ``apply_rotary_pos_emb`` (where its code and its module's ``rotate_half``
  are Llama's) through :func:`dartree_ext.ops.rotary_tables` (the same values as the PyTorch
  form, bit for bit but for a NaN's payload), and
- every MLP whose ``forward`` is ``LlamaMLP.forward`` with SiLU: ``silu(gate) * up`` through
  :func:`dartree_ext.ops.silu_mul` (silu's exp is a polynomial: a value can differ from PyTorch's
  by a few units in the last place in float32, rarely by one in bfloat16) where the op runs a
  vector build (AVX2 + FMA or AVX-512: ``build_info()["vector_build"]``),

for CPU float32 / bfloat16 inputs without autograd (:func:`one_call`); anything else takes the
original code. The ops treat every row alone, so a tree's rows still round as plain steps do (batch invariance, as
``few_rows_linear``). :func:`dartree_ext.linear.set_linear` with ``"few_rows"`` applies it.

    from dartree_ext.row_layers import use_row_layers, restore_row_layers
    use_row_layers(target)       # returns how many norms were patched
    restore_row_layers(target)

The rotary function is replaced in the modeling module itself (it is a module-level function), so
every model of that architecture in the process takes it (it gives the original's values), and
:func:`restore_row_layers` on any of them puts the original back for all of them.
"""
from __future__ import annotations

import sys
import types

import torch

from . import ops
from ._C import build_info

_FLAG = "_dartree_row_layer"  # on a patched module: "norm" or "mlp"


def one_call(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether a step runs as one per-row CPU op: ``x`` float32 / bfloat16 on the CPU, ``others``
    of its dtype and device, and no autograd graph wanted (training keeps the PyTorch forms). The
    drafter's steps ask this too."""
    dtype = x.dtype
    return (x.is_cpu and (dtype is torch.bfloat16 or dtype is torch.float32)
            and all(t.dtype == dtype and t.is_cpu for t in others)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others))))


def _same_code(a, b) -> bool:
    """Whether functions ``a`` and ``b`` run the same code with the same arguments and defaults
    (what they look up in their modules at call time is the caller's to check)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (ca is not None and cb is not None and ca.co_code == cb.co_code and ca.co_consts == cb.co_consts
            and ca.co_names == cb.co_names and ca.co_varnames == cb.co_varnames and ca.co_argcount == cb.co_argcount
            and getattr(a, "__defaults__", None) == getattr(b, "__defaults__", None)
            and getattr(a, "__kwdefaults__", None) == getattr(b, "__kwdefaults__", None))


def _as_written(fn):
    """A modeling module's function as its source defines it. With the ``kernels`` package
    (transformers 5.25 on), ``@use_kernel_forward_from_hub`` turns ``apply_rotary_pos_emb`` into an
    ``nn.Module`` (kernels' ``Func``) whose ``forward`` calls the function, closed over as ``func``:
    that function, while the wrapper's class ``forward`` is its own (not kernelized); ``None`` for
    any other module."""
    if not isinstance(fn, torch.nn.Module):
        return fn
    forward = type(fn).__dict__.get("forward")
    if type(fn).__name__ != "Func" or "forward" in fn.__dict__ or not isinstance(forward, types.FunctionType):
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    inner = cells["func"].cell_contents if "func" in cells else None
    return inner if isinstance(inner, types.FunctionType) else None


def _llama_rotary(fn) -> bool:
    """Whether ``fn`` (a modeling module's ``apply_rotary_pos_emb``) computes Llama's: its code, and
    the ``rotate_half`` its module gives it (NanoChat's and BLT's share the code but rotate
    otherwise)."""
    llama = _llama()
    fn = _as_written(fn)
    ref = _as_written(getattr(llama.apply_rotary_pos_emb, "_dartree_original", llama.apply_rotary_pos_emb))
    globals_ = getattr(fn, "__globals__", {})
    return fn is not None and _same_code(fn, ref) and _same_code(globals_.get("rotate_half"), llama.rotate_half)


def _llama():
    from transformers.models.llama import modeling_llama
    return modeling_llama


def _plain_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm computing exactly ``LlamaRMSNorm.forward`` (not patched by anyone else)."""
    return (isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")
            and _same_code(type(module).forward, _llama().LlamaRMSNorm.forward)
            and ("forward" not in module.__dict__ or hasattr(module, _FLAG)))


def _plain_mlp(module: torch.nn.Module) -> bool:
    """A SwiGLU MLP computing exactly ``LlamaMLP.forward`` with SiLU (not patched by anyone else)."""
    from transformers.activations import SiLUActivation
    act = getattr(module, "act_fn", None)
    return type(act) in (torch.nn.SiLU, SiLUActivation) \
        and all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
        and _same_code(type(module).forward, _llama().LlamaMLP.forward) \
        and ("forward" not in module.__dict__ or hasattr(module, _FLAG))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if one_call(gate, up) and gate.shape == up.shape:
        return self.down_proj(ops.silu_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)  # LlamaMLP.forward's own expression


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if one_call(x, weight) and x.dim() >= 1 and weight.dim() == 1 and x.shape[-1] == weight.shape[0]:
        return ops.rms_norm_rows(x, weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _rotary_fits(q, k, cos, sin, unsqueeze_dim) -> bool:
    return (unsqueeze_dim == 1 and all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin))
            and one_call(q, k, cos, sin) and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape and q.shape[-1] % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
            and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:] and cos.shape[0] in (1, q.shape[0])
            and cos.shape[1] == q.shape[2] and cos.shape[2] == q.shape[3])


def _rotary_for(original):
    """``original`` (a modeling module's ``apply_rotary_pos_emb``) through ``ops.rotary_tables``
    where that fits; the wrapper keeps ``original`` as ``_dartree_original``."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return ops.rotary_tables(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__doc__ = original.__doc__
    apply_rotary_pos_emb._dartree_original = original
    return apply_rotary_pos_emb


def _modeling_modules(model: torch.nn.Module) -> list[types.ModuleType]:
    """The modules defining ``model``'s layers that have a Llama-style ``apply_rotary_pos_emb``."""
    names = {type(m).__module__ for m in model.modules()}
    found = []
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        if _llama_rotary(getattr(fn, "_dartree_original", fn)):
            found.append(mod)
    return found


def vector_silu() -> bool:
    """Whether ``silu_mul`` runs a vector build here (AVX2 + FMA or AVX-512). Its baseline x86-64
    build (two SSE registers a vector, no FMA) is several times slower than PyTorch's activation
    (``bench/ops/ops.py --only rows``), so without one the MLPs (and the drafter's) keep PyTorch's."""
    return _VECTOR_SILU


_VECTOR_SILU = build_info().get("vector_build", "base") != "base"


def use_row_layers(model: torch.nn.Module) -> int:
    """Route ``model``'s Llama-style RMSNorms, rotary embedding and SwiGLU activations through the
    per-row CPU ops (see the module's docstring). Returns how many norms were patched; calling it
    again is harmless."""
    count = 0
    kinds = [("norm", _plain_norm, _norm_forward)]
    if vector_silu():
        kinds.append(("mlp", _plain_mlp, _mlp_forward))
    for module in model.modules():
        for kind, plain, forward in kinds:
            if plain(module):
                setattr(module, _FLAG, kind)
                module.forward = types.MethodType(forward, module)
                count += kind == "norm"
                break
    for mod in _modeling_modules(model):
        if not hasattr(mod.apply_rotary_pos_emb, "_dartree_original"):
            mod.apply_rotary_pos_emb = _rotary_for(mod.apply_rotary_pos_emb)
    return count


def restore_row_layers(model: torch.nn.Module) -> int:
    """Undo :func:`use_row_layers` (the rotary function of ``model``'s modeling modules too).
    Returns how many norms were restored."""
    count = 0
    for module in model.modules():
        kind = getattr(module, _FLAG, None)
        if kind is not None:
            delattr(module, _FLAG)
            if "forward" in module.__dict__:
                del module.forward
            count += kind == "norm"
    for mod in _modeling_modules(model):
        original = getattr(mod.apply_rotary_pos_emb, "_dartree_original", None)
        if original is not None:
            mod.apply_rotary_pos_emb = original
    return count


def row_layers_used(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s layers runs through the per-row ops (:func:`use_row_layers`)."""
    return any(hasattr(m, _FLAG) for m in model.modules())
