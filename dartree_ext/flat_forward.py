"""A Llama model's forward over a cache as one flat function: the same calls in the same order as
transformers' modules make them, without the module machinery around them.

A decoding step of a small model on a CPU spends a third of its time in Python: SmolLM2-135M's
forward is about 400 module calls (each through ``nn.Module.__call__``, the output-capturing
hooks, the keyword-deprecation wrappers, the mask builder) around about 400 kernels. For the
forwards the decoding loops make (new tokens over a cache, a 4D additive mask, token ids, no
gradient), :func:`use_flat_forward` runs ``LlamaForCausalLM.forward`` as one function that calls
each layer's own ``forward`` (``nn.Linear``'s or the one :func:`dartree_ext.linear.set_linear`
installed, the RMSNorms', the rotary embedding's), the modeling module's ``apply_rotary_pos_emb``,
the configured attention function and the cache's ``update`` directly, in transformers' order,
on the same tensors: the logits, the hidden states and the cache are the same bits as the
modules' forward gives (tested). Any other call (a prefill without a mask, ``inputs_embeds``,
labels, attention weights, a selection of hidden states, training, autograd, a ``torch.compile``
trace) takes transformers' forward.

    from dartree_ext.flat_forward import use_flat_forward, restore_module_forward
    use_flat_forward(target)        # True where the model is a plain Llama
    restore_module_forward(target)

Only models whose classes run transformers' Llama code are flattened (``LlamaForCausalLM``,
SmolLM2, the checkpoints that load as Llama): any module with its own forward (a subclass, a
quantized layer class, an instance patched by someone else) or a forward hook other than
transformers' output capture leaves the model as it is. Hooks registered after the call are not
run by flat forwards.
"""
from __future__ import annotations

import types

import torch

_FLAG = "_dartree_flat_forward"  # on a flattened model: its layers, as _Plan


def _llama():
    from transformers.models.llama import modeling_llama
    return modeling_llama


def _own_forward(module: torch.nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` running ``cls.forward`` (an instance forward only where this library
    installed it)."""
    from .linear import _FLAG as FEW_ROWS
    from .quant import _FLAG as QUANT
    from .row_layers import _FLAG as ROW
    if type(module) is not cls:
        return False
    return "forward" not in module.__dict__ or any(hasattr(module, f) for f in (FEW_ROWS, QUANT, ROW))


def _foreign_hooks(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` has hooks other than transformers' output capture."""
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      getattr(module, "_backward_pre_hooks", {})):
            if any(getattr(h, "__name__", "") != "output_capturing_hook" for h in hooks.values()):
                return True
    return False


def flattenable(model: torch.nn.Module) -> bool:
    """Whether :func:`use_flat_forward` can flatten ``model``: a ``LlamaForCausalLM`` whose every
    module runs transformers' Llama code (or this library's row ops), without foreign hooks."""
    llama = _llama()
    if type(model) is not llama.LlamaForCausalLM or "forward" in model.__dict__ and not hasattr(model, _FLAG):
        return False
    inner = getattr(model, "model", None)
    if not _own_forward(inner, llama.LlamaModel) or not _own_forward(model.lm_head, torch.nn.Linear):
        return False
    if not _own_forward(inner.embed_tokens, torch.nn.Embedding) or not _own_forward(inner.norm, llama.LlamaRMSNorm) \
            or not _own_forward(inner.rotary_emb, llama.LlamaRotaryEmbedding):
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (_own_forward(layer, llama.LlamaDecoderLayer) and _own_forward(attn, llama.LlamaAttention)
                and _own_forward(mlp, llama.LlamaMLP)
                and all(_own_forward(m, llama.LlamaRMSNorm) for m in (layer.input_layernorm, layer.post_attention_layernorm))
                and all(_own_forward(getattr(attn, n), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
                and all(_own_forward(getattr(mlp, n), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))):
            return False
    return not _foreign_hooks(model)


def use_flat_forward(model: torch.nn.Module) -> bool:
    """Run ``model``'s decoding forwards as one flat function (see the module's docstring).
    Returns whether the model runs it now; calling it again is harmless."""
    if hasattr(model, _FLAG):
        return True
    if not flattenable(model):
        return False
    setattr(model, _FLAG, True)
    model.forward = types.MethodType(_flat_forward, model)
    return True


def restore_module_forward(model: torch.nn.Module) -> bool:
    """Undo :func:`use_flat_forward`. Returns whether the model was flattened."""
    if not hasattr(model, _FLAG):
        return False
    delattr(model, _FLAG)
    model.__dict__.pop("forward", None)
    return True


def flat(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs flat forwards."""
    return hasattr(model, _FLAG)


_TAKEN = frozenset(("use_cache", "output_hidden_states", "logits_to_keep", "return_dict"))
_NAMES: tuple[str, str] | None = None  # (the forward's cache argument, the output's cache field)


def _cache_names() -> tuple[str, str]:
    """What this transformers calls the cache: ``LlamaForCausalLM.forward``'s argument (``cache``
    from 5.25 on, ``past_key_values`` before) and the output's field."""
    global _NAMES
    if _NAMES is None:
        import dataclasses
        import inspect
        from transformers.modeling_outputs import CausalLMOutputWithPast
        arg = "cache" if "cache" in inspect.signature(_llama().LlamaForCausalLM.forward).parameters else "past_key_values"
        fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        _NAMES = (arg, "cache" if "cache" in fields else "past_key_values")
    return _NAMES


def _flat_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                  **kwargs):
    cache = cache if cache is not None else past_key_values
    hidden_wanted = kwargs.get("output_hidden_states", False)
    if (input_ids is None or position_ids is None or cache is None or attention_mask is None
            or attention_mask.dim() != 4 or not attention_mask.is_floating_point()
            or not kwargs.get("use_cache", True) or kwargs.get("return_dict", True) is False
            or not (hidden_wanted is False or hidden_wanted is True or hidden_wanted is None)
            or not _TAKEN.issuperset(kwargs) or self.training or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and self.lm_head.weight.requires_grad)):
        if cache is not None:
            kwargs[_cache_names()[0]] = cache
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  **kwargs)
    return _decode(self, input_ids, attention_mask, position_ids, cache, bool(hidden_wanted),
                   kwargs.get("logits_to_keep", 0))


def _decode(model, input_ids, mask, position_ids, cache, hidden_wanted: bool, logits_to_keep):
    """``LlamaForCausalLM.forward`` for a call :func:`_flat_forward` takes, each step as the
    modules run it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
    from .row_layers import _FLAG as ROW, one_call
    from . import ops

    llama = _llama()
    inner = model.model
    config = inner.config
    rotary = llama.apply_rotary_pos_emb  # read at call time: row_layers may have replaced it
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, llama.eager_attention_forward)
    x = inner.embed_tokens.forward(input_ids)
    position_embeddings = inner.rotary_emb.forward(x, position_ids=position_ids)
    cos, sin = position_embeddings
    states = [x] if hidden_wanted else None
    input_shape = x.shape[:-1]
    for layer in inner.layers[:config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        residual = x
        h = layer.input_layernorm.forward(x)
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q = attn.q_proj.forward(h).view(hidden_shape).transpose(1, 2)
        k = attn.k_proj.forward(h).view(hidden_shape).transpose(1, 2)
        v = attn.v_proj.forward(h).view(hidden_shape).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, position_ids=position_ids,
                           use_cache=True)
        x = residual + attn.o_proj.forward(out.reshape(*input_shape, -1).contiguous())
        residual = x
        h = layer.post_attention_layernorm.forward(x)
        gate, up = mlp.gate_proj.forward(h), mlp.up_proj.forward(h)
        if hasattr(mlp, ROW) and one_call(gate, up) and gate.shape == up.shape:  # row_layers' _mlp_forward
            h = ops.silu_mul(gate, up)
        else:
            h = mlp.act_fn(gate) * up
        x = residual + mlp.down_proj.forward(h)
        if hidden_wanted:
            states.append(x)
    x = inner.norm.forward(x)
    if hidden_wanted:
        states[-1] = x
    logits = model.lm_head.forward(slice_logits_to_keep(x, logits_to_keep))
    return CausalLMOutputWithPast(logits=logits, hidden_states=tuple(states) if hidden_wanted else None,
                                  **{_cache_names()[1]: cache})
