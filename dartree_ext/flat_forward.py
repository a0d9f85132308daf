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
trace) takes transformers' forward. The calls are resolved once per model (a plan, rebuilt when
a module, weight or patch it read is replaced; see the section below): the per-row norm ops and
the GGUF block ops are called directly, q/k/v and gate/up in one block-op call each.

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

import operator
import types
import weakref
from typing import Callable, NamedTuple

import torch

_FLAG = "_dartree_flat_forward"  # on a flattened model


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


def _transformers_has_what_it_calls() -> bool:
    """Whether this transformers has the helpers the flat forward calls (``slice_logits_to_keep``,
    ``ALL_ATTENTION_FUNCTIONS.get_interface``, both in transformers 5.25); one without them keeps
    their own forward."""
    from transformers import modeling_utils
    functions = getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
    return hasattr(modeling_utils, "slice_logits_to_keep") and hasattr(functions, "get_interface")


def flattenable(model: torch.nn.Module) -> bool:
    """Whether :func:`use_flat_forward` can flatten ``model``: a ``LlamaForCausalLM`` whose every
    module runs transformers' Llama code (or this library's row ops), without foreign hooks, under
    a transformers that has the helpers the flat forward calls."""
    llama = _llama()
    if not _transformers_has_what_it_calls():
        return False
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
    _PLANS.pop(model, None)
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

    llama = _llama()
    inner = model.model
    config = inner.config
    rotary = llama.apply_rotary_pos_emb  # read at call time: row_layers may have replaced it
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, llama.eager_attention_forward)
    x = inner.embed_tokens.forward(input_ids)
    position_embeddings = inner.rotary_emb.forward(x, position_ids=position_ids)
    cos, sin = position_embeddings
    states = [x] if hidden_wanted else None
    plan = _plan(model, direct=True) if not torch.is_grad_enabled() else None
    if plan is None or not plan.takes(x):
        plan = _plan(model, direct=False)
    x = _run_plan(plan, x, cos, sin, mask, position_ids, cache, states, attention, rotary)
    x = inner.norm.forward(x)
    if hidden_wanted:
        states[-1] = x
    logits = model.lm_head.forward(slice_logits_to_keep(x, logits_to_keep))
    return CausalLMOutputWithPast(logits=logits, hidden_states=tuple(states) if hidden_wanted else None,
                                  **{_cache_names()[1]: cache})


# ---- the plan: what the flat forward calls, resolved once -----------------------------------------
#
# Resolving each layer's calls (which forward a module runs, whether a row op takes it) costs
# about 5 ms of a 17 ms one-token SmolLM2-135M forward on a 2-vCPU Xeon. A plan resolves them once
# per model: the norms' weights where row_layers patched them (ops.rms_norm_rows called
# directly), the linear layers patched with GGUF blocks (their block op called directly, and
# sibling layers on one buffer, q/k/v and gate/up, in one call: each output element of the block
# ops is computed alone, so one call over the joined rows gives each layer's bits), every other
# layer's own forward. Which rotary and attention calls apply is decided at the first layer of a
# forward (every layer has the same shapes). The plan records every object it read (the modules,
# their forwards, patch flags, norm weights and epsilons, attention scalings) and is used only
# while each is still the same object: a module or weight replaced, a layer re-patched, rebuilds it.

_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, _Plan]]" = weakref.WeakKeyDictionary()


class _Layer(NamedTuple):
    """One decoder layer as a plan runs it. A norm is ``(module, weight, eps)`` with ``weight`` None
    where its module's forward runs; a linear group a callable giving its layers' outputs."""
    norm_in: tuple
    qkv: Callable
    o_proj: Callable
    attn: torch.nn.Module
    layer_idx: int
    scaling: float
    given_scaling: float | None
    norm_post: tuple
    gate_up: Callable
    down: Callable
    silu: bool
    mlp: torch.nn.Module


class _Plan:
    """A model's decoder layers resolved: ``direct`` ones call the row and block ops themselves;
    the other (every call autograd or more rows need) runs each module's own forward."""
    __slots__ = ("layers", "checks", "head_dim", "max_rows", "norm_dtype", "counts", "stack", "__weakref__")

    def valid(self) -> bool:
        dicts, keys, values = self.checks  # compared in C loops (map), not a generator: ~3x faster
        return all(map(operator.is_, map(dict.get, dicts, keys), values))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a forward of ``x`` (the embedded tokens) runs the plan: the conditions every
        direct block-op call of the plan shares (CPU, float32 / bfloat16, at most max_rows rows)."""
        return (x.is_cpu and (x.dtype is torch.float32 or x.dtype is torch.bfloat16)
                and 0 < x.numel() <= self.max_rows * x.shape[-1])


def plan_summary(model: torch.nn.Module) -> dict | None:
    """What the flat forward of ``model`` runs directly (its plan, built on first use): ``{"layers",
    "joined_calls" (one block-op call for sibling layers), "block_calls" (direct block-op calls in
    all), "norms" (direct ops.rms_norm_rows)}``, or ``None`` where the model is not flattened."""
    if not flat(model):
        return None
    plan = _plan(model, direct=True)
    return {"layers": len(plan.layers), "joined_calls": plan.counts[0], "block_calls": plan.counts[1],
            "norms": sum(norm[1] is not None for layer in plan.layers for norm in (layer.norm_in, layer.norm_post))}


def _plan(model, direct: bool) -> _Plan:
    plans = _PLANS.setdefault(model, {})
    plan = plans.get(direct)
    if plan is None or not plan.valid():
        plan = plans[direct] = _build_plan(model, direct)
    return plan


def _build_plan(model, direct: bool) -> _Plan:
    from . import ops
    from .quant import _FLAG as QUANT, _quant_forward, joined_rows
    from .row_layers import _FLAG as ROW, _norm_forward
    inner = model.model
    layers = inner.layers
    checks = [(model._modules, "model", inner), (inner._modules, "layers", layers)]
    checks += [(layers._modules, k, v) for k, v in layers._modules.items()]
    counts = [0, 0]
    max_rows = [1 << 62]
    norm_dtypes = set()

    def watch(module, *names):
        checks.extend((module.__dict__, n, module.__dict__.get(n)) for n in ("forward", QUANT, ROW, *names))

    def norm(module):
        watch(module, "variance_epsilon")
        weight = module._parameters.get("weight")
        checks.append((module._parameters, "weight", weight))
        forward = module.__dict__.get("forward")
        if (direct and getattr(forward, "__func__", None) is _norm_forward and weight is not None
                and weight.dim() == 1 and weight.is_cpu):
            norm_dtypes.add(weight.dtype)
            return (module, weight, module.variance_epsilon)
        return (module, None, None)

    def block_flag(module):
        watch(module)
        checks.append((module._parameters, "bias", module._parameters.get("bias")))
        flag = module.__dict__.get(QUANT)
        if getattr(module.__dict__.get("forward"), "__func__", None) is _quant_forward and module.bias is None:
            return flag
        return None

    def linears(modules):
        """One callable running ``modules`` (siblings reading one input): a tuple of their outputs."""
        flags = [block_flag(m) for m in modules]
        if direct and all(flags):
            for f in flags:
                max_rows[0] = min(max_rows[0], f[2])
            op = [ops._ops.quant_linear.default, ops._ops.quant_linear_int8.default]
            joined = joined_rows([f[1] for f in flags]) if len({(f[0], f[3]) for f in flags}) == 1 else None
            if joined is not None and len(modules) > 1:
                counts[0] += 1
                counts[1] += 1
                run, kind, sizes = op[flags[0][3]], flags[0][0], [f[1].shape[0] for f in flags]
                groups.append((joined, kind, flags[0][3], sizes))
                return lambda h: run(h, joined, kind, None).split(sizes, -1)
            counts[1] += len(flags)
            calls = [(op[f[3]], f[1], f[0]) for f in flags]
            if len(calls) == 1:
                (run, blocks, kind), = calls
                groups.append((blocks, kind, flags[0][3], [blocks.shape[0]]))
                return lambda h: (run(h, blocks, kind, None),)
            groups.append(None)
            return lambda h: tuple(run(h, blocks, kind, None) for run, blocks, kind in calls)
        groups.append(None)
        forwards = [m.forward for m in modules]
        return lambda h: tuple(f(h) for f in forwards)

    entries, groups = [], []  # groups: each linear group's (blocks, kind, int8, sizes), None where not direct
    for layer in layers[:inner.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        for parent, names in ((layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                              (attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (mlp, ("gate_proj", "up_proj", "down_proj"))):
            checks.extend((parent._modules, n, parent._modules.get(n)) for n in names)
        watch(attn, "scaling", "layer_idx", "head_dim")
        watch(mlp)
        silu = hasattr(mlp, ROW) and mlp.gate_proj.out_features == mlp.up_proj.out_features
        scaling = attn.head_dim ** -0.5 if attn.scaling is None else float(attn.scaling)
        entries.append(_Layer(norm(layer.input_layernorm), linears((attn.q_proj, attn.k_proj, attn.v_proj)),
                              linears((attn.o_proj,)), attn, attn.layer_idx, scaling, attn.scaling,
                              norm(layer.post_attention_layernorm), linears((mlp.gate_proj, mlp.up_proj)),
                              linears((mlp.down_proj,)), silu, mlp))
    plan = _Plan()
    plan.layers = entries
    plan.checks = tuple(zip(*checks))  # (dicts, keys, the values read)
    plan.head_dim = layers[0].self_attn.head_dim if len(layers) else 0
    plan.max_rows = max_rows[0]
    plan.norm_dtype = norm_dtypes.pop() if len(norm_dtypes) == 1 else None
    plan.counts = tuple(counts)
    plan.stack = _decoder_stack(entries, groups, plan.head_dim) if direct and plan.norm_dtype is not None else None
    return plan


def _decoder_stack(entries: list[_Layer], groups: list, head_dim: int):
    """The layers as one C++ loop (``_C.DecoderStack``: the direct plan's calls from C++), where
    every layer's calls are direct: both norms, q / k / v and gate / up each one joined call, o and
    down one call each, the fused SiLU; else ``None``."""
    from ._C import DecoderStack
    if not entries or any(g is None for g in groups) or not all(
            e.norm_in[1] is not None and e.norm_post[1] is not None and e.silu for e in entries):
        return None
    layer_groups = [groups[4 * i:4 * i + 4] for i in range(len(entries))]
    if any([len(g[3]) for g in lg] != [3, 1, 2, 1] for lg in layer_groups):
        return None
    return DecoderStack(norms=[w for e in entries for w in (e.norm_in[1], e.norm_post[1])],
                        eps=[float(v) for e in entries for v in (e.norm_in[2], e.norm_post[2])],
                        blocks=[g[0] for lg in layer_groups for g in lg], kinds=[g[1] for lg in layer_groups for g in lg],
                        int8=[bool(g[2]) for lg in layer_groups for g in lg],
                        sizes=[list(g[3]) for lg in layer_groups for g in lg],
                        scalings=[e.scaling for e in entries], head_dim=head_dim)


def _run_plan(plan: _Plan, x, cos, sin, mask, position_ids, cache, states, attention, rotary):
    """The decoder layers of ``LlamaModel.forward`` as the plan resolved them: the modules' calls in
    their order on the same tensors (a direct op where the module's forward would call it), the
    same bits."""
    from .attention import _hf_attention, _packable, few_rows_kernel_fits
    from .row_layers import _rotary_fits, one_call
    from . import ops
    norm_op = ops._ops.rms_norm_rows.default if x.dtype == plan.norm_dtype else None
    rotary_op, attention_op, silu_op = ops._ops.rotary_tables.default, ops._ops.few_rows_attention.default, \
        ops._ops.silu_mul.default
    input_shape = x.shape[:-1]
    hidden_shape = (*input_shape, -1, plan.head_dim)
    direct_rotary = direct_attention = None  # decided at the first layer: every layer has its shapes
    keys, visible = -1, mask
    stack = plan.stack if norm_op is not None else None
    for i, (n1, qkv, o_proj, attn, idx, scaling, given_scaling, n2, gate_up, down, silu, mlp) in enumerate(plan.layers):
        if i == 1 and stack is not None and direct_rotary and direct_attention:
            out = _run_stack(stack, x, cos, sin, visible, cache, states)
            if out is not None:
                return out
        residual = x
        h = norm_op(x, n1[1], n1[2]) if norm_op is not None and n1[1] is not None else n1[0].forward(x)
        q, k, v = qkv(h)
        q, k, v = q.view(hidden_shape).transpose(1, 2), k.view(hidden_shape).transpose(1, 2), \
            v.view(hidden_shape).transpose(1, 2)
        if direct_rotary is None:
            direct_rotary = hasattr(rotary, "_dartree_original") and _rotary_fits(q, k, cos, sin, 1)
        q, k = rotary_op(q, k, cos, sin) if direct_rotary else rotary(q, k, cos, sin)
        k, v = cache.update(k, v, idx)
        if direct_attention is None:
            keys = k.shape[-2]
            visible = mask if mask.shape[-1] == keys else mask[:, :, :, :keys]
            direct_attention = (attention is _hf_attention
                                and _packable(attn, q, mask, 0.0, {}, grouped=False)
                                and few_rows_kernel_fits(q, k, v, visible))
        if direct_attention and k.shape[-2] == keys:
            out = attention_op(q, k, v, visible, scaling).transpose(1, 2).contiguous()
        else:
            out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=given_scaling, position_ids=position_ids,
                               use_cache=True)
        x = residual + o_proj(out.reshape(*input_shape, -1).contiguous())[0]
        residual = x
        h = norm_op(x, n2[1], n2[2]) if norm_op is not None and n2[1] is not None else n2[0].forward(x)
        gate, up = gate_up(h)
        if silu and one_call(gate, up) and gate.shape == up.shape:  # row_layers' _mlp_forward
            h = silu_op(gate, up)
        else:
            h = mlp.act_fn(gate) * up
        x = residual + down(h)[0]
        if states is not None:
            states.append(x)
    return x


def _run_stack(stack, x, cos, sin, visible, cache, states):
    """Layers 1 on of a forward whose first layer ran every call directly, as one C++ loop, where
    the cache is a transformers ``Cache`` of this library's growing layers (keys and values the
    first slots of buffers with room); else ``None``, nothing run."""
    layers = getattr(cache, "layers", None)
    if (layers is None or len(layers) < len(stack) or getattr(cache, "offloading", False)
            or type(cache).update is not _cache_update()):
        return None
    rest = layers[1:len(stack)]
    if not all(getattr(type(layer), "_dartree_growing", False) and "update" in type(layer).__dict__ for layer in rest):
        return None
    found = stack.run(x, cos, sin, visible, 1, [layer.keys for layer in rest], [layer.values for layer in rest],
                      [layer.__dict__.get("key_buffer") for layer in rest],
                      [layer.__dict__.get("value_buffer") for layer in rest], states is not None)
    if found is None:
        return None
    outs, keys, values = found
    for layer, k, v in zip(rest, keys, values):  # what the layers' update sets
        layer.keys = layer._keys_view = k
        layer.values = layer._values_view = v
    if states is not None:
        states.extend(outs)
    return outs[-1]


_UPDATE = None


def _cache_update():
    global _UPDATE
    if _UPDATE is None:
        from transformers.cache_utils import Cache
        _UPDATE = Cache.update
    return _UPDATE
