"""Drafter models (sizes, persistence, mismatch errors) and the transformers Cache helper."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext import reference  # noqa: E402
from dartree_ext.decoding import compact_cache_, select_requests_  # noqa: E402
from dartree_ext.models import BlockDrafter, default_target_layers  # noqa: E402

from models import tiny_drafter, tiny_target  # noqa: E402


def test_default_target_layers():
    assert default_target_layers(30) == (1, 15, 29)
    assert default_target_layers(2) == (1,)
    assert default_target_layers(1) == (1,)
    assert all(1 <= i <= 29 for i in default_target_layers(30, 5))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_from_target_shapes(kind):
    target = tiny_target(kind)
    drafter = tiny_drafter(target)
    assert drafter.config.target_model_type == kind
    # the target's embedding and LM head are used, not owned
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in drafter.parameters())
    assert drafter.embedding is target.get_input_embeddings()
    with torch.no_grad():
        out = target(torch.randint(0, 97, (2, 7)), output_hidden_states=True)
        ctx = drafter.project_context(drafter.target_features(out.hidden_states))
        draft = drafter(torch.tensor([3, 4]), torch.tensor([7, 5]), ctx, torch.arange(7)[None].expand(2, -1),
                        torch.ones(2, 7, dtype=torch.bool))
    assert draft.hidden.shape == (2, 5, 32) and draft.base_logits.shape == (2, 5, 97)
    assert ctx.shape == (2, 7, 32)


def test_context_mask_hides_slots():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ctx = torch.randn(1, 6, 32)
    mask = torch.tensor([[True, True, True, False, False, False]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        a = drafter(torch.tensor([5]), torch.tensor([3]), ctx, pos, mask).base_logits
        ctx2 = ctx.clone()
        ctx2[:, 3:] = torch.randn(1, 3, 32)
        b = drafter(torch.tensor([5]), torch.tensor([3]), ctx2, pos, mask).base_logits
        c = drafter(torch.tensor([5]), torch.tensor([3]), ctx2, pos, torch.ones(1, 6, dtype=torch.bool)).base_logits
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_save_and_load(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    loaded = BlockDrafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    for (n, p), (m, q) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q)
    with pytest.raises(ValueError, match="vocab_size"):
        BlockDrafter.from_pretrained(tmp_path, tiny_target(vocab=101))
    with pytest.raises(ValueError, match="hidden_size"):
        BlockDrafter.from_pretrained(tmp_path, tiny_target(hidden=48))
    with pytest.raises(FileNotFoundError):
        BlockDrafter.from_pretrained(tmp_path / "nothing", target)


def test_root_in_masks(tmp_path):
    """``root_in_masks``: every mask input is the mask embedding plus the root's embedding. For one
    request that equals a drafter without the option whose mask embedding already holds the root's
    embedding; the option adds no parameter, survives save/load, and a config without the key
    (drafters saved before it existed) loads with it off."""
    import json
    from dartree_ext.models.drafter import CONFIG_NAME
    target = tiny_target()
    on = tiny_drafter(target, root_in_masks=True)
    off = tiny_drafter(target)
    assert [n for n, _ in on.named_parameters()] == [n for n, _ in off.named_parameters()]
    root, ctx, pos, mask = torch.tensor([5]), torch.randn(1, 6, 32), torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        plain = off(root, torch.tensor([6]), ctx, pos, mask).base_logits
        off.mask_embedding.add_(target.get_input_embeddings()(root)[0])
        shifted = off(root, torch.tensor([6]), ctx, pos, mask).base_logits
        ours = on(root, torch.tensor([6]), ctx, pos, mask).base_logits
    torch.testing.assert_close(ours, shifted)
    assert not torch.allclose(ours, plain)
    on.save_pretrained(tmp_path)
    assert BlockDrafter.from_pretrained(tmp_path, target).config.root_in_masks is True
    with open(tmp_path / CONFIG_NAME) as f:
        cfg = json.load(f)
    del cfg["root_in_masks"]
    with open(tmp_path / CONFIG_NAME, "w") as f:
        json.dump(cfg, f)
    assert BlockDrafter.from_pretrained(tmp_path, target).config.root_in_masks is False


def test_correction_head_matches_tree_reference():
    """The module's teacher-forced corrected logits equal the tree ops' reference head on the
    same branch (the exported tensors are the module's)."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    head = drafter.export_head()
    hidden, base = torch.randn(1, 4, 32), torch.randn(1, 4, 97)
    tokens = torch.tensor([[7, 9, 11, 13]])
    with torch.no_grad():
        corrected = drafter.correction_head(hidden, base, tokens, drafter.embedding)
        z = head.project(hidden)
        state = torch.zeros(1, 16)
        for d in range(4):
            ids = torch.arange(97)[None, None]
            logq = reference.corrected_logprobs(head, z[:, d], ids[:, 0], base[:, d], state[None])[0, 0]
            torch.testing.assert_close(logq, torch.log_softmax(corrected[0, d], -1), atol=1e-5, rtol=1e-5)
            state = reference.gru_update(head, tokens[:, d], state)


def test_export_head_reused_until_weights_change():
    """export_head returns the same tensors while the weights are unchanged, and a fresh GRU
    table after an in-place update (an optimizer step) or for another dtype."""
    drafter = tiny_drafter(tiny_target())
    first = drafter.export_head()
    assert drafter.export_head() is first
    assert drafter.export_head(torch.float64).gru_table.dtype == torch.float64
    with torch.no_grad():
        drafter.embedding.weight.add_(1.0)
    fresh = drafter.export_head()
    assert fresh is not first
    expected = drafter.embedding.weight @ drafter.correction_head.gru.weight_ih.T + drafter.correction_head.gru.bias_ih
    torch.testing.assert_close(fresh.gru_table, expected.detach())
    assert not torch.allclose(fresh.gru_table, first.gru_table)


@pytest.mark.parametrize("cache_kind", ["dynamic", "growing", "static"])
def test_compact_cache(cache_kind):
    from transformers import DynamicCache, StaticCache
    from dartree_ext.decoding.hf import new_cache
    target = tiny_target()
    cache = {"dynamic": lambda: DynamicCache(config=target.config), "growing": lambda: new_cache(target),
             "static": lambda: StaticCache(config=target.config, max_cache_len=16)}[cache_kind]()
    with torch.no_grad():
        target(torch.randint(0, 97, (2, 10)), use_cache=True, **{"cache": cache})
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    src = torch.tensor([[4, 6, 9], [3, 8, 8]])
    dst = torch.tensor([2, 1])
    lengths = torch.tensor([3, 2], dtype=torch.int32)
    compact_cache_(cache, src, dst, lengths, new_length=5)
    for (k0, v0), layer in zip(before, cache.layers):
        assert layer.keys.shape[2] == (16 if cache_kind == "static" else 5)
        for b in range(2):
            for i in range(int(lengths[b])):
                torch.testing.assert_close(layer.keys[b, :, dst[b] + i], k0[b, :, src[b, i]])
                torch.testing.assert_close(layer.values[b, :, dst[b] + i], v0[b, :, src[b, i]])
            torch.testing.assert_close(layer.keys[b, :, :dst[b]], k0[b, :, :dst[b]])
    select_requests_(cache, torch.tensor([1]))
    assert all(layer.keys.shape[0] == 1 for layer in cache.layers)


def test_growing_cache_writes_in_place_and_matches_a_dynamic_cache():
    """new_cache's layers: the same keys and values as a DynamicCache through prefill, steps, a crop
    by slicing and a batch selection, written into one buffer while it has room (no copy of the
    cache a step), the buffer replaced when it fills or its tensors were replaced."""
    from transformers import DynamicCache
    from dartree_ext.decoding.hf import layer_buffers, new_cache
    from dartree_ext.decoding.cache import crop_cache_
    target = tiny_target()
    grow, plain = new_cache(target), DynamicCache(config=target.config)
    assert all(type(layer).__name__ == "GrowingLayer" for layer in grow.layers)
    gen = torch.Generator().manual_seed(0)

    def step(n):
        ids = torch.randint(0, 97, (2, n), generator=gen)
        with torch.no_grad():
            a = target(ids, use_cache=True, cache=grow).logits
            b = target(ids, use_cache=True, cache=plain).logits
        assert torch.equal(a, b)
        for g, p in zip(grow.layers, plain.layers):
            assert torch.equal(g.keys, p.keys) and torch.equal(g.values, p.values)

    step(10)
    buffer = layer_buffers(grow.layers[0])[0]
    assert buffer.shape[2] == 10 + 64
    for _ in range(5):
        step(3)
    assert layer_buffers(grow.layers[0])[0].data_ptr() == buffer.data_ptr()  # in place
    crop_cache_(grow, 20)
    crop_cache_(plain, 20)
    step(2)
    assert layer_buffers(grow.layers[0])[0].data_ptr() == buffer.data_ptr()
    step(60)  # past the room: a larger buffer
    assert layer_buffers(grow.layers[0])[0].shape[2] > 74
    select_requests_(grow, torch.tensor([1]))
    select_requests_(plain, torch.tensor([1]))
    assert layer_buffers(grow.layers[0]) is None  # replaced tensors: adopted at the next update
    ids = torch.randint(0, 97, (1, 4), generator=gen)
    with torch.no_grad():
        assert torch.equal(target(ids, use_cache=True, cache=grow).logits,
                           target(ids, use_cache=True, cache=plain).logits)
    assert layer_buffers(grow.layers[0]) is not None


def test_decoding_on_a_growing_cache_matches_a_dynamic_cache(monkeypatch):
    """The loop's outputs (T = 0, plain and tree methods) with the growing cache and with a
    transformers DynamicCache are the same."""
    from transformers import DynamicCache
    from dartree_ext.decoding import SpeculativeDecoder, phases
    target = tiny_target()
    drafter = tiny_drafter(target, seed=2)
    prompts = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    outputs = {}
    for kind in ("growing", "dynamic"):
        if kind == "dynamic":
            monkeypatch.setattr(phases, "new_cache", lambda t: DynamicCache(config=t.config))
        outputs[kind] = [SpeculativeDecoder(target, drafter if m != "ar" else None, m, budget=12)
                         .generate(prompts, max_new_tokens=24).sequences for m in ("ar", "dartree", "ddtree")]
    for a, b in zip(outputs["growing"], outputs["dynamic"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layers", [1, 2])
def test_init_from_target_reproduces_the_last_layer(layers):
    """A drafter started from the target: its first layer, fed the target's input to its last
    layer at token t and the context before t, gives the target's own logits at t."""
    target = tiny_target(layers=3)
    drafter = tiny_drafter(target, init_from_target=True, num_layers=layers)
    assert drafter.config.target_layer_ids[-1] == 2   # = the input of the target's last layer
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        ctx = drafter.project_context(drafter.target_features(out.hidden_states))
        last = target.model.layers[-1]
        torch.testing.assert_close(ctx, last.input_layernorm(out.hidden_states[2]), rtol=1e-5, atol=1e-5)
        for t in (0, 4, 8):
            layer = drafter.layers[-1] if layers == 1 else drafter.layers[0]
            x = layer(out.hidden_states[2][:, t:t + 1], torch.full((2, 1), t), ctx[:, :t],
                      torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool))
            logits = drafter.lm_head(drafter.norm(x))[:, 0]
            if layers == 1:
                torch.testing.assert_close(logits, out.logits[:, t], rtol=1e-4, atol=1e-4)
            else:  # the first of two copied layers is the target's second-to-last: not its output
                assert not torch.allclose(logits, out.logits[:, t], atol=1e-2)
    for mine, theirs in zip(drafter.layers, target.model.layers[-layers:]):
        assert torch.equal(mine.down_proj.weight, theirs.mlp.down_proj.weight)
        assert mine.down_proj.weight.data_ptr() != theirs.mlp.down_proj.weight.data_ptr()   # a copy, not shared
    # a fresh drafter is not the target's layer
    plain = tiny_drafter(target, num_layers=layers)
    assert not torch.equal(plain.layers[0].q_proj.weight, target.model.layers[-layers].self_attn.q_proj.weight)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_init_from_target_rejects_other_layer_kinds(kind):
    with pytest.raises(ValueError, match="llama-style"):
        tiny_drafter(tiny_target(kind), init_from_target=True)


def test_lookup_drafter_follows_the_base_dtype():
    """A LookupDrafter over a bfloat16 drafter is a bfloat16 drafter: its head exports (the
    target's bfloat16 embedding meets the drafter's own GRU weights) and it drafts a tree."""
    from dartree_ext.models import LookupDrafter
    from dartree_ext.tree import build_dartree
    target = tiny_target().to(torch.bfloat16)
    base = tiny_drafter(target).to(torch.bfloat16)
    oracle = LookupDrafter(base, [torch.arange(20)], miss=0.0)
    assert oracle.dtype == torch.bfloat16 and {p.dtype for p in oracle.parameters()} == {torch.bfloat16}
    for (name, mine), theirs in zip(oracle.state_dict().items(), base.state_dict().values()):
        assert torch.equal(mine, theirs), name
    head = oracle.export_head()
    assert {t.dtype for t in (head.w_z, head.w_s, head.fc2_weight, head.gru_table, head.w_hh)} == {torch.bfloat16}
    root = torch.tensor([3])
    with torch.no_grad():
        out = oracle(root, root, oracle.empty_context(1), torch.zeros(1, 0, dtype=torch.long),
                     torch.zeros(1, 0, dtype=torch.bool))
        assert out.hidden.dtype == out.base_logits.dtype == torch.bfloat16
        assert out.base_logits[0].argmax(-1).tolist() == [4, 5, 6, 7, 8]  # what follows 3 in the sequence
        tree = build_dartree(head, out.hidden, out.base_logits, root, torch.zeros(1, 16, dtype=torch.bfloat16), k=4,
                             width=2, budget=6)
    assert int(tree.num_nodes[0]) == 7


def test_drafter_context_kv_equals_projecting_the_context():
    """forward(..., context_kv=context_kv(context)) equals forward(...) on the same context, with
    grouped-query heads, a batch of 2 and a context of 1 row broadcast over it."""
    target = tiny_target()
    drafter = tiny_drafter(target, num_layers=2)
    assert drafter.config.num_heads != drafter.config.num_kv_heads
    gen = torch.Generator().manual_seed(3)
    for rows in (2, 1):
        ctx = torch.randn(rows, 9, drafter.config.hidden_size, generator=gen)
        pos = torch.arange(9)[None].expand(rows, -1)
        valid = torch.rand(rows, 9, generator=gen) > 0.3
        roots, root_pos = torch.tensor([3, 5]), torch.tensor([9, 9])
        with torch.no_grad():
            want = drafter(roots, root_pos, ctx, pos, valid)
            kv = drafter.context_kv(ctx, pos)
            assert len(kv) == 2 and kv[0].shape == (rows, 9, 2, drafter.config.num_kv_heads, drafter.config.head_dim)
            got = drafter(roots, root_pos, ctx, pos, valid, context_kv=kv)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.base_logits, want.base_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("linear", ["torch", "few_rows"])
@pytest.mark.parametrize("layers", [1, 2])
def test_drafter_positions_are_the_full_pass_prefix(linear, layers):
    """forward(..., positions=p) gives the full pass's first p positions (hidden states and base
    logits; bit for bit with few_rows_linear, which is batch-invariant), and only those."""
    from dartree_ext.linear import set_linear
    target = tiny_target()
    drafter = tiny_drafter(target, num_layers=layers)
    set_linear(drafter, linear)
    # the drafter's head is the target's lm_head, which runs as the target's set-up does (as
    # load_target + load_drafter set them up); torch's GEMM is not batch-invariant on every CPU
    set_linear(target, linear)
    gen = torch.Generator().manual_seed(5)
    ctx = torch.randn(2, 7, drafter.config.hidden_size, generator=gen)
    pos, valid = torch.arange(7)[None].expand(2, -1), torch.rand(2, 7, generator=gen) > 0.2
    roots, root_pos = torch.tensor([3, 5]), torch.tensor([7, 7])
    with torch.no_grad():
        full = drafter(roots, root_pos, ctx, pos, valid)
        for p in (1, 3, drafter.config.block_size - 1):
            part = drafter(roots, root_pos, ctx, pos, valid, positions=p)
            assert part.hidden.shape[1] == p and part.base_logits.shape[1] == p
            if linear == "few_rows":
                assert torch.equal(part.hidden, full.hidden[:, :p])
                assert torch.equal(part.base_logits, full.base_logits[:, :p])
            else:
                torch.testing.assert_close(part.base_logits, full.base_logits[:, :p], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="positions"):
            drafter(roots, root_pos, ctx, pos, valid, positions=drafter.config.block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_steps_in_one_call_match_their_pytorch_form(dtype):
    """The drafter's RMSNorm and rotary embedding as one CPU op each (inference) against their
    PyTorch forms (what training runs): float32 to rounding, bfloat16 within one unit in the last
    place; heads as a strided view, positions broadcast from one row; bad input raises."""
    from dartree_ext import ops
    from dartree_ext.models.drafter import RMSNorm, _rope
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(40, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=gen))
    x = (torch.randn(3, 7, 40, generator=gen) * 3).to(dtype)
    want = norm(x.requires_grad_(dtype is torch.float32))  # the PyTorch form (autograd wanted)
    assert torch.equal(want, reference.rms_norm_rows(x, norm.weight, 1e-5))
    with torch.no_grad():
        got = norm(x.detach())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(got, want.detach(), **tol)
    assert torch.equal(got, ops.rms_norm_rows(x.detach(), norm.weight.detach(), 1e-5))

    heads = torch.randn(2, 9, 4, 16, generator=gen).to(dtype).transpose(1, 2)  # [B, H, T, Dh], strided
    for positions in (torch.randint(0, 4000, (2, 9), generator=gen), torch.arange(30, 39)[None]):
        want = reference.rotary_rows(heads, positions, 10000.0)
        got = _rope(heads, positions, 10000.0)
        assert got.shape == want.shape and got.is_contiguous()
        tol = dict(atol=2e-4, rtol=1e-4) if dtype is torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
        torch.testing.assert_close(got, want, **tol)
    one = heads[:1]  # one request's heads at two requests' positions: broadcast, as the PyTorch form does
    positions = torch.randint(0, 4000, (2, 9), generator=gen)
    torch.testing.assert_close(_rope(one, positions, 10000.0), reference.rotary_rows(one, positions, 10000.0), **tol)
    with pytest.raises(RuntimeError, match="even Dh"):
        ops.rotary_rows(torch.randn(1, 2, 3, 5), torch.arange(3)[None], 10000.0)
    with pytest.raises(RuntimeError, match="positions must be"):
        ops.rotary_rows(torch.randn(1, 2, 3, 4), torch.arange(4)[None], 10000.0)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm_rows(torch.randn(2, 4), torch.randn(5), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm_rows(torch.randn(2, 4).half(), torch.randn(4).half(), 1e-5)
