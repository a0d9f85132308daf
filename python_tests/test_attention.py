"""gqa_attention (grouped-query attention without repeated keys/values) against SDPA over
repeated heads, its transformers registration, bad input, and lossless decoding through it; the
row-invariant CPU kernel few_rows_attention against its reference, row by row against a plain
step's attention (bit for bit), and bfloat16 decoding through it equal to plain decoding."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dartree_ext.attention as attention
from dartree_ext import ops, reference
from dartree_ext.attention import (MAX_PACKED_ROWS, NAME, attention_kind, gqa_attention, restore_sdpa_attention,
                                   use_packed_attention)
from dartree_ext.decoding.decoder import SpeculativeDecoder
from dartree_ext.loading import load_target, tiny_target


def _repeated(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask, scale=scale)


def _qkv(b, heads, kv_heads, t, s, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, d, generator=gen).to(dtype)
    k = torch.randn(b, kv_heads, s, d, generator=gen).to(dtype)
    v = torch.randn(b, kv_heads, s, d, generator=gen).to(dtype)
    return q, k, v, gen


@pytest.mark.parametrize("b,heads,kv_heads,t,s", [(1, 9, 3, 6, 40), (2, 4, 2, 17, 33), (3, 8, 1, 1, 20),
                                                   (1, 6, 6, 5, 12), (2, 9, 3, 65, 130)])
@pytest.mark.parametrize("kind", ["none", "bool_rows", "float_rows", "bool_shared"])
def test_matches_repeated_heads(b, heads, kv_heads, t, s, kind):
    q, k, v, gen = _qkv(b, heads, kv_heads, t, s, 16, seed=b * 100 + t)
    visible = torch.rand(b, 1, t, s, generator=gen) < 0.7
    visible[..., 0] = True  # every row sees something
    mask = {"none": None, "bool_rows": visible,
            "float_rows": torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min),
            "bool_shared": visible[:, :, :1]}[kind]
    out = gqa_attention(q, k, v, mask, scale=0.3)
    assert out.shape == (b, heads, t, 16)
    torch.testing.assert_close(out, _repeated(q, k, v, mask, scale=0.3), atol=2e-6, rtol=1e-5)


def test_head_order_is_the_groups():
    """Query head h reads key/value head h // (H / H_kv): a hand-built case where each key/value
    head holds one constant value."""
    q = torch.zeros(1, 4, 2, 8)
    k = torch.zeros(1, 2, 3, 8)
    v = torch.stack([torch.full((3, 8), 1.0), torch.full((3, 8), 5.0)])[None]
    out = gqa_attention(q, k, v, torch.ones(1, 1, 2, 3, dtype=torch.bool))
    assert out[0, :2].eq(1.0).all() and out[0, 2:].eq(5.0).all()


def test_mask_tiling_follows_the_rows():
    """Row t of every head sees only what row t of the mask shows (a different key per row)."""
    q, k, _, _ = _qkv(1, 6, 2, 3, 3, 8)
    v = torch.arange(3.0)[None, None, :, None].expand(1, 2, 3, 8).contiguous()
    out = gqa_attention(q, k, v, torch.eye(3, dtype=torch.bool)[None, None])
    assert torch.equal(out[0, :, :, 0], torch.arange(3.0)[None].expand(6, 3))


def test_bad_input():
    q, k, v, _ = _qkv(1, 9, 3, 4, 10, 8)
    with pytest.raises(ValueError, match="split"):
        gqa_attention(q[:, :8], k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="one mask for every head"):
        gqa_attention(q, k, v, torch.ones(1, 9, 4, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected"):
        gqa_attention(q[0], k[0], v[0])


def _tree_forward(model, n_prompt=12, parents=(-1, 0, 0, 1, 1, 2)):
    gen = torch.Generator().manual_seed(0)
    cache = {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"):
             DynamicCache(config=model.config)}
    ids = torch.randint(0, 256, (1, n_prompt), generator=gen)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache)
        par = torch.tensor([parents], dtype=torch.int32)
        n = len(parents)
        mask = ops.tree_attention_mask(par, torch.tensor([n], dtype=torch.int32),
                                       torch.ones(1, n_prompt, dtype=torch.bool), torch.float32)
        depth = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
        tokens = torch.randint(0, 256, (1, n), generator=gen)
        return model(input_ids=tokens, attention_mask=mask, position_ids=(n_prompt + depth)[None], use_cache=True,
                     **cache).logits


def _count_rows(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` (an attention function) so each call records its query rows."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    return calls


def test_transformers_model_through_it(monkeypatch):
    """A tree forward of an SDPA model gives the same logits through gqa_attention, which runs in
    every layer (counted), while a prefill longer than MAX_PACKED_ROWS keeps SDPA's own path."""
    model = tiny_target()
    assert attention_kind(model) == "sdpa"
    plain = _tree_forward(model)
    assert use_packed_attention(model) and attention_kind(model) == NAME
    monkeypatch.setattr(attention, "USE_FEW_ROWS_KERNEL", False)  # the CPU kernel: its own test below
    calls = _count_rows(monkeypatch, attention, "gqa_attention")
    packed = _tree_forward(model)
    assert calls == [6] * model.config.num_hidden_layers
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    calls.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, MAX_PACKED_ROWS + 1)))
    assert calls == []
    restore_sdpa_attention(model)
    assert attention_kind(model) == "sdpa"


def test_other_attention_left_alone():
    model = tiny_target()
    model.set_attn_implementation("eager")
    assert not use_packed_attention(model) and attention_kind(model) == "eager"


def test_load_target_packs():
    assert attention_kind(load_target("tiny").target) == NAME


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["chain", "dartree", "ddtree"])
def test_greedy_decoding_lossless_through_it(kind, method):
    """float32, 3 requests of different lengths, an oracle drafter (long accepted paths): every
    method's output through the packed attention equals HF greedy generate's through SDPA."""
    from dartree_ext.models import LookupDrafter
    from models import greedy_reference, tiny_drafter
    from models import tiny_target as test_target
    model = test_target(kind)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 11, 1)]
    refs = [greedy_reference(model, p, 24) for p in prompts]
    assert use_packed_attention(model)
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
    oracle = LookupDrafter(tiny_drafter(model), [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    out = SpeculativeDecoder(model, oracle, method, budget=24, width=4, K=8).generate(ids, mask, max_new_tokens=24)
    assert out.stats.tau > 2.0
    for b, ref in enumerate(refs):
        assert out.sequences[b, width:].tolist() == ref.tolist()


# few_rows_attention (the row-invariant CPU kernel) ---------------------------------------------

def _hidden(visible: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,heads,kv_heads,t,s,d,dv", [(1, 9, 3, 9, 209, 64, 64), (2, 4, 4, 5, 37, 32, 32),
                                                        (1, 9, 3, 1, 201, 64, 64), (3, 8, 2, 17, 100, 128, 128),
                                                        (2, 16, 1, 3, 5, 80, 24), (1, 2, 2, 130, 7, 8, 8),
                                                        (1, 6, 3, 4, 50, 64, 64), (2, 10, 2, 3, 33, 16, 48),
                                                        (1, 9, 3, 9, 256, 64, 64), (1, 4, 2, 3, 240, 32, 32)])
@pytest.mark.parametrize("kind", ["none", "rows", "shared", "one_row_per_batch"])
def test_few_rows_kernel_matches_reference(dtype, b, heads, kv_heads, t, s, d, dv, kind):
    gen = torch.Generator().manual_seed(b * 1000 + t * 10 + s)
    q = torch.randn(b, heads, t, d, generator=gen).to(dtype)
    k = torch.randn(b, kv_heads, s, d, generator=gen).to(dtype)
    v = torch.randn(b, kv_heads, s, dv, generator=gen).to(dtype)
    shape = {"none": None, "rows": (b, 1, t, s), "shared": (1, 1, t, s), "one_row_per_batch": (b, 1, 1, s)}[kind]
    mask = None
    if shape is not None:
        visible = torch.rand(shape, generator=gen) < 0.6
        visible[..., 0] = True
        mask = _hidden(visible, dtype) + (torch.randn(shape, generator=gen) * visible).to(dtype)  # a bias too
    out = ops.few_rows_attention(q, k, v, mask, 0.3)
    ref = reference.few_rows_attention(q, k, v, mask, 0.3)
    assert out.dtype == dtype and out.shape == (b, heads, t, dv)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    if dtype == torch.float32 and mask is not None and t <= 128:  # against SDPA on repeated heads too
        torch.testing.assert_close(out, _repeated(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_kernel_rows_are_plain_steps(dtype):
    """A tree's rows, verified in one call, give bit for bit what each token gets decoded plainly:
    the prefix plus its ancestors' keys, compacted to consecutive slots, in a call of its own
    (one row, no hidden key). Also with other rows beside it and a strided (transposed) query."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, prefix = 9, 3, 64, 150
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8, 9, 6]
    n = len(parents)
    keys = torch.randn(1, kv_heads, prefix + n, d, generator=gen).to(dtype)
    values = torch.randn(1, kv_heads, prefix + n, d, generator=gen).to(dtype)
    query = torch.randn(1, n, heads, d, generator=gen).to(dtype).transpose(1, 2)  # as transformers passes it
    visible = torch.zeros(1, 1, n, prefix + n, dtype=torch.bool)
    visible[..., :prefix] = True
    visible[..., 7] = False  # a hidden prefix slot (left padding, say)
    paths = []
    for i, p in enumerate(parents):
        path = (paths[p] if p >= 0 else []) + [i]
        paths.append(path)
        visible[0, 0, i, [prefix + j for j in path]] = True
    tree = ops.few_rows_attention(query, keys, values, _hidden(visible, dtype))
    for i in range(n):
        slots = visible[0, 0, i].nonzero()[:, 0]
        plain = ops.few_rows_attention(query[:, :, i:i + 1].contiguous(), keys[:, :, slots].contiguous(),
                                       values[:, :, slots].contiguous(), torch.zeros(1, 1, 1, len(slots), dtype=dtype))
        assert torch.equal(tree[:, :, i], plain[:, :, 0]), i
        alone = ops.few_rows_attention(query[:, :, i:i + 1], keys, values, _hidden(visible[:, :, i:i + 1], dtype))
        assert torch.equal(tree[:, :, i], alone[:, :, 0]), i


def test_few_rows_kernel_a_row_that_sees_nothing():
    """A row whose mask hides every key takes the formula over all keys, and a row of -inf gives 0:
    both SDPA's answers."""
    q, k, v, _ = _qkv(1, 4, 2, 3, 6, 8)
    mask = torch.zeros(1, 1, 3, 6)
    mask[0, 0, 0] = torch.finfo(torch.float32).min
    mask[0, 0, 0, 2] = torch.finfo(torch.float32).min / 2  # hidden too, but not like the others
    mask[0, 0, 2] = float("-inf")
    out = ops.few_rows_attention(q, k, v, mask)
    assert not out.isnan().any() and torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    torch.testing.assert_close(out, _repeated(q, k, v, mask), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, reference.few_rows_attention(q, k, v, mask), atol=1e-6, rtol=1e-5)


def test_few_rows_kernel_fits_only_what_it_takes():
    q, k, v, _ = _qkv(1, 4, 2, 3, 6, 8)
    mask = torch.zeros(1, 1, 3, 6)
    fits = attention.few_rows_kernel_fits
    assert fits(q, k, v, mask) and fits(q, k, v, None) and fits(q, k, v, mask[:, :, :1])
    assert not fits(q, k, v, mask.half())  # float16's minimum would not hide a key
    assert not fits(q, k, v, mask[..., :5]) and not fits(q, k, v, torch.zeros(1, 1, 3, 1))
    assert not fits(q.half(), k.half(), v.half(), mask)
    assert not fits(q, k[..., :4], v, mask)
    assert not fits(q.requires_grad_(), k, v, mask)
    with torch.no_grad():
        assert fits(q, k, v, mask)


def test_few_rows_kernel_bad_input():
    q, k, v, _ = _qkv(1, 4, 2, 3, 6, 8)
    with pytest.raises(ValueError, match="query heads over"):
        ops.few_rows_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="share a dtype"):
        ops.few_rows_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.few_rows_attention(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="mask must be additive"):
        ops.few_rows_attention(q, k, v, torch.zeros(1, 2, 3, 6))
    with pytest.raises(ValueError, match="mask must be additive"):
        ops.few_rows_attention(q, k, v, torch.zeros(1, 1, 3, 5))
    with pytest.raises(ValueError, match="floating-point"):
        ops.few_rows_attention(q, k, v, torch.ones(1, 1, 3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not match"):
        ops.few_rows_attention(q, k[:, :, :, :4], v)
    with pytest.raises(ValueError, match="contiguous"):
        ops.few_rows_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    with pytest.raises(ValueError, match="head dims"):
        ops.few_rows_attention(torch.zeros(1, 2, 1, 300), torch.zeros(1, 2, 4, 300), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="no keys"):
        ops.few_rows_attention(q, k[:, :, :0], v[:, :, :0])


def test_transformers_model_through_the_kernel(monkeypatch):
    """A tree forward of a float32 model on a CPU runs the kernel in every layer, with SDPA's logits."""
    model = tiny_target()
    plain = _tree_forward(model)
    assert use_packed_attention(model)
    calls = _count_rows(monkeypatch, ops, "few_rows_attention")
    kernel = _tree_forward(model)
    assert calls == [6] * model.config.num_hidden_layers
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["dartree", "chain"])
def test_bfloat16_decoding_equals_plain_decoding_through_the_kernel(method, monkeypatch):
    """In bfloat16 on a CPU, with few_rows_linear and the kernel (both row-invariant), a method's
    output equals plain decoding's token for token, though trees and plain steps run different row
    counts. Through packed SDPA instead both methods' runs parted from plain decoding (torch 2.14,
    CPU); not asserted, as that rests on SDPA's rounding."""
    from dartree_ext.linear import use_few_rows_linear
    from dartree_ext.models import LookupDrafter
    from models import tiny_drafter
    from models import tiny_target as test_target
    model = test_target("llama", vocab=97, hidden=64, layers=4, seed=5).to(torch.bfloat16)
    use_few_rows_linear(model)
    assert use_packed_attention(model)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (9, 4, 14)]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1

    def run():
        ar = SpeculativeDecoder(model, None, "ar").generate(ids, mask, max_new_tokens=40)
        refs = [torch.cat([p, ar.sequences[b, width:]]) for b, p in enumerate(prompts)]
        drafter = LookupDrafter(tiny_drafter(model).to(torch.bfloat16), refs, miss=0.3)
        out = SpeculativeDecoder(model, drafter, method, budget=12, width=4, K=6).generate(ids, mask, max_new_tokens=40)
        return ar.sequences, out

    monkeypatch.setattr(attention, "USE_FEW_ROWS_KERNEL", True)
    calls = _count_rows(monkeypatch, ops, "few_rows_attention")
    ar, out = run()
    assert out.stats.tau > 1.5 and max(calls) > 1  # trees went through the kernel
    assert torch.equal(out.sequences, ar)
