"""The flat forward (dartree_ext.flat_forward) gives the modules' forward's bits: logits, hidden
states and cache, for every linear set-up, attention kind and dtype; calls it does not take fall
back to the modules; models it cannot flatten are left alone."""
from __future__ import annotations

import copy

import pytest
import torch

from dartree_ext import flat_forward
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
@pytest.mark.parametrize("linear", ["torch", "few_rows", "gguf", "amx"])
@pytest.mark.parametrize("attention", ["sdpa", "packed", "eager"])
def test_flat_forward_gives_the_modules_bits(dtype, linear, attention):
    if linear == "amx" and (dtype != torch.bfloat16 or not amx_available()):
        pytest.skip("amx: bfloat16 on a CPU with AMX tiles")
    if linear == "gguf":
        model = quantized_model("q4_1", hidden=64, layers=2)
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
