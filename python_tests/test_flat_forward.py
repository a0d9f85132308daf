"""The flat forward (dartree_ext.flat_forward) gives the modules' forward's bits: logits, hidden
states and cache, for every linear set-up, attention kind and dtype; calls it does not take fall
back to the modules; models it cannot flatten are left alone."""
from __future__ import annotations

import copy

import pytest
import torch

from dartree_ext import flat_forward, quant
from dartree_ext.attention import use_packed_attention
from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.decoding.hf import additive_mask, new_cache
from dartree_ext.linear import amx_available, set_linear
from models import quantized_model, tiny_drafter, tiny_target


def _pair(model):
    """``model`` and a flattened copy."""
    flat = copy.deepcopy(model)
    assert flat_forward.use_flat_forward(flat) and flat_forward.flat(flat) and not flat_forward.flat(model)
    return model, flat


def _steps(model, dtype, batch=2, prompt=9, tree=5, hidden=True):
    """A left-padded prefill under a 4D mask, then a tree step (a chain and a branch), as the
    decoding loop calls the target: every output and the cache's contents."""
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    pad = torch.tensor([0, 3][:batch])
    ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
    slot = torch.arange(prompt)
    visible = (slot[None, :, None] >= slot[None, None, :]) & (slot[None, None, :] >= pad[:, None, None])
    visible |= torch.eye(prompt, dtype=torch.bool)
    cache = new_cache(model)
    outs = []
    with torch.inference_mode():
        outs.append(model(input_ids=ids, attention_mask=additive_mask(visible, dtype)[:, None],
                          position_ids=(slot - pad[:, None]).clamp(min=0), cache=cache, use_cache=True,
                          output_hidden_states=hidden, logits_to_keep=1))
        parents = torch.tensor([-1, 0, 1, 0, 3][:tree])
        tvis = torch.zeros(tree, tree, dtype=torch.bool)
        for i in range(tree):
            j = i
            while j >= 0:
                tvis[i, j] = True
                j = int(parents[j])
        past = slot[None, :] >= pad[:, None]
        full = torch.cat([past[:, None, :].expand(batch, tree, prompt), tvis[None].expand(batch, -1, -1)], -1)
        tok = torch.randint(0, vocab, (batch, tree), generator=gen)
        depth = torch.tensor([0, 1, 2, 1, 2][:tree])
        outs.append(model(input_ids=tok, attention_mask=additive_mask(full, dtype)[:, None],
                          position_ids=(prompt - pad)[:, None] + depth, cache=cache, use_cache=True,
                          output_hidden_states=hidden))
    layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return outs, layers


def _assert_same(a, b):
    (outs_a, cache_a), (outs_b, cache_b) = a, b
    for oa, ob in zip(outs_a, outs_b):
        assert torch.equal(oa.logits, ob.logits)
        assert (oa.hidden_states is None) == (ob.hidden_states is None)
        if oa.hidden_states is not None:
            assert len(oa.hidden_states) == len(ob.hidden_states)
            assert all(torch.equal(x, y) for x, y in zip(oa.hidden_states, ob.hidden_states))
    assert all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(cache_a, cache_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", ["torch", "few_rows", "gguf", "gguf_int8", "amx"])
@pytest.mark.parametrize("attention", ["sdpa", "packed", "eager"])
def test_flat_forward_gives_the_modules_bits(dtype, linear, attention):
    if linear == "amx" and (dtype != torch.bfloat16 or not amx_available()):
        pytest.skip("amx: bfloat16 on a CPU with AMX tiles")
    if linear.startswith("gguf"):
        model = quantized_model("q4_1", hidden=64, layers=2, int8=linear == "gguf_int8")
    elif linear == "amx":
        model = tiny_target("llama", hidden=64, layers=3).bfloat16()
        set_linear(model, "amx")
    else:
        model = tiny_target("llama", hidden=32, layers=3)
        set_linear(model, linear)
    model = model.to(dtype)
    if attention == "packed":
        assert use_packed_attention(model)
    elif attention == "eager":
        model.set_attn_implementation("eager")
    modules, flat = _pair(model)
    for hidden in (True, False):
        _assert_same(_steps(modules, dtype, hidden=hidden), _steps(flat, dtype, hidden=hidden))


@pytest.mark.parametrize("int8", [False, True])
def test_the_plan_runs_sibling_block_layers_in_one_call(int8):
    model = quantized_model("q4_1", hidden=64, layers=2, int8=int8)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    parts = [quant.layer_blocks(m)[1] for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    joined = quant.joined_rows(parts)  # one buffer of their rows, no copy
    assert joined is not None and joined.data_ptr() == parts[0].data_ptr()
    assert quant.joined_rows([parts[0], parts[2]]) is None  # not consecutive
    assert quant.joined_rows([quant.layer_blocks(m)[1] for m in (mlp.gate_proj, mlp.up_proj)]) is not None
    if int8:  # packing is row-wise: the joined packing is each layer's
        for p, m in zip(parts, (attn.q_proj, attn.k_proj, attn.v_proj)):
            assert torch.equal(p, quant.pack_int8(quant.quantize(m.weight, "q4_1"), "q4_1"))
    assert flat_forward.plan_summary(model) is None  # not flattened
    modules, flat = _pair(model)
    summary = flat_forward.plan_summary(flat)
    assert summary == {"layers": 2, "joined_calls": 4, "block_calls": 8, "norms": 4}
    _assert_same(_steps(modules, torch.float32), _steps(flat, torch.float32))
    # a prefill of more rows than the block layers take (2 x 40 > 65): the plan of module forwards
    _assert_same(_steps(modules, torch.float32, prompt=40), _steps(flat, torch.float32, prompt=40))
    assert not flat_forward._PLANS[flat][False].counts[1]
    # siblings' blocks given as separate tensors are copied into one buffer
    q = attn.q_proj
    quant.restore_quant_linear(model)
    layers = {n: ("q4_1", quant.quantize(m.weight, "q4_1").clone()) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear)}
    set_linear(model, "few_rows")
    quant.use_quant_linear(model, layers, int8=int8)
    assert quant.joined_rows([quant.layer_blocks(m)[1] for m in (q, attn.k_proj, attn.v_proj)]) is not None
    assert all(b.is_contiguous() for _, b in (quant.layer_blocks(m) for m in (q, attn.k_proj)))


def test_the_plan_follows_what_changes_in_the_model():
    """A module, a weight or a patch replaced after the first flat forward: the next one runs the
    model as it is now (the plan is rebuilt), the same bits as the modules'."""
    model = quantized_model("q4_1", hidden=64, layers=2)
    modules, flat = _pair(model)
    _assert_same(_steps(modules, torch.float32), _steps(flat, torch.float32))
    first = flat_forward._PLANS[flat][True]

    def change(m, how):
        layer = m.model.layers[1]
        if how == "weight":
            with torch.no_grad():
                layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight * 1.5)
        elif how == "epsilon":
            layer.post_attention_layernorm.variance_epsilon = 0.25
        elif how == "unpatched":
            for proj in (layer.self_attn.k_proj, layer.mlp.down_proj):
                delattr(proj, quant._FLAG)
                del proj.forward
        elif how == "module":
            torch.manual_seed(5)
            layer.self_attn.o_proj = torch.nn.Linear(layer.self_attn.o_proj.in_features,
                                                     layer.self_attn.o_proj.out_features, bias=False)
        elif how == "norm_forward":
            del layer.input_layernorm.forward

    for how in ("weight", "epsilon", "unpatched", "module", "norm_forward"):
        change(modules, how)
        change(flat, how)
        if how == "module":
            flat.model.layers[1].self_attn.o_proj.load_state_dict(modules.model.layers[1].self_attn.o_proj.state_dict())
        _assert_same(_steps(modules, torch.float32), _steps(flat, torch.float32))
        assert flat_forward._PLANS[flat] is not first
        first = flat_forward._PLANS[flat][True]
    assert flat_forward.plan_summary(flat)["block_calls"] < 8


class _Counted:
    """A plan's DecoderStack that counts the forwards it ran (``runs``) and declined (``declined``)."""

    def __init__(self, stack):
        self.stack, self.runs, self.declined = stack, 0, 0

    def __len__(self):
        return len(self.stack)

    def run(self, *args):
        found = self.stack.run(*args)
        self.runs += found is not None
        self.declined += found is None
        return found


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layers_after_the_first_run_as_one_cpp_loop(int8, dtype):
    """With every call of a layer direct (block layers, norm ops, packed attention, a growing
    cache), layers 1 on run in ``_C.DecoderStack``: the modules' bits, the cache's views and
    buffers as the layers' own update leaves them; a cache it cannot write (no room, another
    layout) is left to the layers' update."""
    model = quantized_model("q4_1", hidden=64, layers=3, int8=int8).to(dtype)
    assert use_packed_attention(model)
    modules, flat = _pair(model)
    plan = flat_forward._plan(flat, True)
    assert plan.stack is not None and len(plan.stack) == 3
    plan.stack = counted = _Counted(plan.stack)
    for hidden in (True, False):
        _assert_same(_steps(modules, dtype, hidden=hidden), _steps(flat, dtype, hidden=hidden))
    assert counted.runs == 2 and counted.declined == 2  # the tree steps; the prefills find empty layers

    # a buffer without room for the step: declined, the layers' update grows it
    cache = new_cache(flat)
    ids = torch.randint(0, flat.config.vocab_size, (1, 6))
    with torch.inference_mode():
        flat(input_ids=ids, cache=cache, use_cache=True)
        for layer in cache.layers:
            layer.key_buffer, layer.value_buffer = layer.key_buffer[:, :, :6], layer.value_buffer[:, :, :6]
        step = dict(input_ids=ids[:, :2], attention_mask=torch.zeros(1, 1, 2, 8, dtype=dtype),
                    position_ids=torch.tensor([[6, 7]]), use_cache=True)
        twin = copy.deepcopy(cache)
        out = flat(cache=cache, **step)
        assert counted.declined == 3 and all(layer.key_buffer.shape[2] > 8 for layer in cache.layers)
        ref = modules(cache=twin, **step)
        assert torch.equal(out.logits, ref.logits)
        out = flat(cache=cache, **{**step, "attention_mask": torch.zeros(1, 1, 2, 10, dtype=dtype),
                                   "position_ids": torch.tensor([[8, 9]])})
        assert counted.runs == 3
        for layer in cache.layers:  # what GrowingLayer.update leaves: views of the buffers, the step's slots
            assert layer.keys is layer._keys_view and layer.keys.shape[2] == 10
            assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()
            assert layer.values is layer._values_view and layer.values.data_ptr() == layer.value_buffer.data_ptr()
        ref = modules(cache=twin, **{**step, "attention_mask": torch.zeros(1, 1, 2, 10, dtype=dtype),
                                     "position_ids": torch.tensor([[8, 9]])})
        assert torch.equal(out.logits, ref.logits)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(cache.layers, twin.layers))
    # a cache of transformers' own layers: declined
    from transformers import DynamicCache
    runs = counted.runs
    a, b = DynamicCache(config=flat.config), DynamicCache(config=flat.config)
    with torch.inference_mode():
        flat(input_ids=ids, cache=a, use_cache=True)
        modules(input_ids=ids, cache=b, use_cache=True)
        assert torch.equal(flat(cache=a, **step).logits, modules(cache=b, **step).logits)
    assert counted.runs == runs


def test_a_plan_goes_with_its_model():
    import gc
    import weakref
    model = quantized_model("q4_1", hidden=64, layers=2)
    assert flat_forward.use_flat_forward(model)
    _steps(model, torch.float32)
    twin = copy.deepcopy(model)  # a copy builds its own plan, over its own modules
    _steps(twin, torch.float32)
    assert flat_forward._PLANS[twin] is not flat_forward._PLANS[model]
    assert flat_forward._PLANS[twin][True].layers[0].attn is twin.model.layers[0].self_attn
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and ref not in [weakref.ref(m) for m in flat_forward._PLANS]
    assert flat_forward.restore_module_forward(twin) and twin not in flat_forward._PLANS


def test_calls_it_does_not_take_run_the_modules():
    modules, flat = _pair(tiny_target("llama"))
    ids = torch.randint(0, 97, (1, 6))
    calls = []
    original = flat_forward._decode
    flat_forward._decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.inference_mode():
            for kwargs in ({}, {"cache": new_cache(flat)}, {"output_attentions": True, "cache": new_cache(flat)},
                           {"output_hidden_states": [1], "cache": new_cache(flat)}):
                a = modules(input_ids=ids, **{k: (new_cache(modules) if k == "cache" else v) for k, v in kwargs.items()})
                b = flat(input_ids=ids, **kwargs)
                assert torch.equal(a.logits, b.logits)
                if kwargs.get("output_attentions"):
                    assert b.attentions is not None
        assert not calls  # no mask, no positions, attention weights, a selection: the modules' forward
        emb = flat.model.embed_tokens(ids)
        with torch.inference_mode():
            assert torch.equal(flat(inputs_embeds=emb).logits, modules(inputs_embeds=emb).logits)
        flat.train()
        loss = flat(input_ids=ids, labels=ids).loss  # training, with autograd: the modules' forward
        loss.backward()
        assert flat.lm_head.weight.grad is not None and not calls
        flat.eval()
        _steps(flat, torch.float32)
        assert len(calls) == 2
    finally:
        flat_forward._decode = original


def test_models_it_cannot_flatten_are_left_alone():
    hooked = tiny_target("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert not flat_forward.use_flat_forward(hooked) and "forward" not in hooked.__dict__

    class Mine(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    custom = tiny_target("llama")
    custom.model.layers[1].self_attn.o_proj.__class__ = Mine
    assert not flat_forward.use_flat_forward(custom)
    assert not flat_forward.use_flat_forward(tiny_target("qwen2"))
    from transformers import modeling_utils
    helper = modeling_utils.slice_logits_to_keep
    del modeling_utils.slice_logits_to_keep  # a transformers without the helpers it calls
    try:
        assert not flat_forward.use_flat_forward(tiny_target("llama"))
    finally:
        modeling_utils.slice_logits_to_keep = helper
    model = tiny_target("llama")
    assert flat_forward.use_flat_forward(model) and flat_forward.use_flat_forward(model)  # again: harmless
    assert flat_forward.restore_module_forward(model) and not flat_forward.flat(model)
    assert "forward" not in model.__dict__ and not flat_forward.restore_module_forward(model)


def test_decoding_with_a_flat_target_gives_the_same_tokens():
    target = tiny_target("llama", layers=2)
    set_linear(target, "few_rows")
    drafter = tiny_drafter(target)
    modules, flat = _pair(target)
    prompts = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    for method in ("ar", "dartree"):
        outs = [SpeculativeDecoder(t, drafter, method, budget=16).generate(prompts, max_new_tokens=12).sequences
                for t in (modules, flat)]
        assert torch.equal(outs[0], outs[1])
