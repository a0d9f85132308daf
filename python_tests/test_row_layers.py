"""A transformers model's RMSNorms and rotary embedding through the per-row CPU ops
(dartree_ext.row_layers, ops.rotary_tables): the op against transformers' function and the
reference, bad input, the patch (what it takes, what it leaves, autograd, restore), and decoding
through it."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import ops, reference, row_layers
from dartree_ext.decoding import left_pad
from dartree_ext.decoding.decoder import SpeculativeDecoder
from dartree_ext.linear import set_linear
from dartree_ext.row_layers import restore_row_layers, row_layers_used, use_row_layers

from models import tiny_drafter, tiny_target

DTYPES = [torch.float32, torch.bfloat16]


def _llama():
    from transformers.models.llama import modeling_llama
    return modeling_llama


def _original_rotary():
    fn = _llama().apply_rotary_pos_emb
    return getattr(fn, "_dartree_original", fn)


def _tables(batch, t, d, dtype, gen, scale=40.0):
    angles = torch.rand(batch, t, d // 2, generator=gen) * scale
    return torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,h,kv,t,d,tb", [(1, 9, 3, 7, 64, 1), (2, 4, 2, 5, 32, 2), (2, 4, 4, 1, 8, 1),
                                           (3, 2, 1, 33, 16, 3), (1, 1, 1, 1, 2, 1)])
def test_rotary_tables_is_transformers_bit_for_bit(dtype, b, h, kv, t, d, tb):
    gen = torch.Generator().manual_seed(b * 100 + t)
    q = torch.randn(b, t, h, d, generator=gen).to(dtype).transpose(1, 2)  # as transformers passes them
    k = torch.randn(b, t, kv, d, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = _tables(tb, t, d, dtype, gen)
    got = ops.rotary_tables(q, k, cos, sin)
    want = _original_rotary()(q, k, cos, sin)
    ref = reference.rotary_tables(q, k, cos, sin)
    for g, w, r in zip(got, want, ref):
        assert g.is_contiguous() and g.dtype == dtype and g.shape == w.shape
        assert torch.equal(g, w) and torch.equal(g, r)
    # contiguous inputs, and a batch of 2 reading one table
    q2, k2 = q.contiguous(), k.contiguous()
    assert all(torch.equal(g, w) for g, w in zip(ops.rotary_tables(q2, k2, cos, sin), ops.rotary_tables(q, k, cos, sin)))


def test_rotary_tables_handles_extremes():
    """Large values, infinities and NaN as the PyTorch form has them."""
    q = torch.tensor([[[[3e38, -3e38, float("inf"), float("nan")]]]])
    k = torch.tensor([[[[1.0, -2.0, 0.0, -0.0]]]])
    cos = torch.tensor([[[0.5, -1.0, 0.5, -1.0]]])
    sin = torch.tensor([[[2.0, 0.25, 2.0, 0.25]]])
    for got, want in zip(ops.rotary_tables(q, k, cos, sin), _original_rotary()(q, k, cos, sin)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_rotary_tables_bad_input():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    cos, sin = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    with pytest.raises(RuntimeError, match="even Dh"):
        ops.rotary_tables(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rotary_tables(q.half(), k.half(), cos.half(), sin.half())
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rotary_tables(q, k.bfloat16(), cos, sin)
    with pytest.raises(RuntimeError, match="cos / sin"):
        ops.rotary_tables(q, k, cos.bfloat16(), sin)
    with pytest.raises(RuntimeError, match=r"\[B or 1, T, Dh\]"):
        ops.rotary_tables(q, k, torch.randn(1, 4, 4), torch.randn(1, 4, 4))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.rotary_tables(q, torch.randn(1, 1, 2, 4), cos, sin)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.rotary_tables(torch.randn(1, 2, 4, 3).transpose(2, 3), k, cos, sin)
    with pytest.raises(RuntimeError, match="differ"):
        ops.rotary_tables(torch.randn(2, 2, 3, 4), torch.randn(2, 1, 3, 4), torch.randn(2, 3, 4), torch.randn(1, 3, 4))


def test_rotary_tables_opcheck():
    gen = torch.Generator().manual_seed(0)
    cos, sin = _tables(2, 5, 8, torch.float32, gen)
    torch.library.opcheck(torch.ops.dartree_ext.rotary_tables.default,
                          (torch.randn(2, 5, 3, 8).transpose(1, 2), torch.randn(2, 1, 5, 8), cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(4)
    edges = torch.tensor([-100.0, 100.0, 0.0, -0.0, float("inf"), -float("inf")] * 3 + [1.0] * 32)
    gate = torch.cat([torch.randn(3, 7, 50, generator=gen) * 6, edges.expand(3, 2, 50)], 1).to(dtype)
    up = torch.randn(gate.shape, generator=gen).to(dtype)
    got, want = ops.silu_mul(gate, up), reference.silu_mul(gate, up)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan())
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-30, rtol=2 ** -7)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **tol)
    strided = ops.silu_mul(gate.transpose(0, 1), up.transpose(0, 1))  # any strides: read as contiguous copies
    torch.testing.assert_close(strided, got.transpose(0, 1), rtol=0, atol=0, equal_nan=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_every_build(dtype):
    """Each build this CPU runs (AVX-512: 16 lanes; AVX2 + FMA and baseline: 8), at lengths around
    the lane counts: against PyTorch (bfloat16: the same bits away from -88, where PyTorch's silu
    is still a tiny negative number; so silu is rounded to bfloat16 before the product), -0 below
    -88, and AVX-512 against AVX2 bit for bit (the same FMAs a lane)."""
    gen = torch.Generator().manual_seed(5)
    inputs = {}
    for n in (1, 7, 8, 9, 15, 16, 17, 33, 1536 * 3 + 5):
        gate = (torch.randn(n, generator=gen) * 8).to(dtype)
        gate[::5] = -90.0  # below -88: -0
        inputs[n] = gate, torch.randn(n, generator=gen).to(dtype)
    ran, fastest = {}, row_layers.build_info()["vector_build"]  # the build silu_mul runs
    for build in ("avx512", "avx2", "base"):
        for n, (gate, up) in inputs.items():
            try:
                got = torch.ops.dartree_ext.silu_mul_build(gate, up, build)
            except RuntimeError as err:  # not this CPU (or not an x86 build)
                assert "has no" in str(err) or "only its portable loop" in str(err)
                break
            want = reference.silu_mul(gate, up)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            else:
                ordinary = (gate.float() > -80) & (want != 0)
                assert torch.equal(_bits(got[ordinary]), _bits(want[ordinary])), build
            assert torch.equal(torch.signbit(got[::5]), torch.signbit(want[::5])), build  # -0 (times up)
            assert torch.equal(_bits(got), _bits(ops.silu_mul(gate, up))) or build != fastest
            ran[build, n] = got
    assert any(b in ("base", "avx2", "avx512") for b, _ in ran)
    for (build, n), got in ran.items():
        if build == "avx512" and ("avx2", n) in ran:
            assert torch.equal(_bits(got), _bits(ran["avx2", n]))
    with pytest.raises(RuntimeError, match="build must be|only its portable loop"):
        torch.ops.dartree_ext.silu_mul_build(torch.randn(3), torch.randn(3), "sse9")


def test_silu_mul_bad_input_and_opcheck():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.randn(3).half(), torch.randn(3).half())
    with pytest.raises(RuntimeError, match="up must match"):
        ops.silu_mul(torch.randn(3), torch.randn(4))
    with pytest.raises(RuntimeError, match="up must match"):
        ops.silu_mul(torch.randn(3), torch.randn(3).bfloat16())
    torch.library.opcheck(torch.ops.dartree_ext.silu_mul.default, (torch.randn(2, 5, 8), torch.randn(2, 5, 8)))
    # the test-only entry through one build: the portable loop runs on every CPU
    torch.library.opcheck(torch.ops.dartree_ext.silu_mul_build.default,
                          (torch.randn(2, 5, 8), torch.randn(2, 5, 8), "base"))
    torch.library.opcheck(torch.ops.dartree_ext.silu_mul_build.default,
                          (torch.randn(3, 17).bfloat16(), torch.randn(3, 17).bfloat16(), "base"))


def _count(monkeypatch, name):
    calls = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_model(kind, dtype, monkeypatch):
    model = tiny_target(kind, hidden=64, layers=3).to(dtype)
    ids = torch.randint(0, 97, (2, 9))
    norms = sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    try:
        with torch.no_grad():
            before = model(ids).logits
            assert use_row_layers(model) == norms and row_layers_used(model)
            assert use_row_layers(model) == norms                          # again: harmless
            norm_calls, rotary_calls = _count(monkeypatch, "rms_norm_rows"), _count(monkeypatch, "rotary_tables")
            mlp_calls = _count(monkeypatch, "silu_mul")
            patched = model(ids).logits
            assert len(norm_calls) == norms and len(rotary_calls) == 3    # every norm; one rotary call a layer
            assert len(mlp_calls) == 3                                     # one MLP a layer
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
        torch.testing.assert_close(patched.float(), before.float(), **tol)
    finally:
        assert restore_row_layers(model) == norms and not row_layers_used(model)
    assert not hasattr(_llama().apply_rotary_pos_emb, "_dartree_original")  # the module's own function again
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_patched_model_keeps_autograd(monkeypatch):
    model = tiny_target("llama", hidden=32, layers=2)
    ids = torch.randint(0, 97, (1, 6))
    model(ids).logits.sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    try:
        use_row_layers(model)
        calls = _count(monkeypatch, "rms_norm_rows") + _count(monkeypatch, "rotary_tables") + \
            _count(monkeypatch, "silu_mul")
        model(ids).logits.sum().backward()                                # the PyTorch forms while grads are needed
        assert not calls
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, w)
    finally:
        restore_row_layers(model)


def test_patch_leaves_other_norms_alone():
    """A norm computing something else (Gemma's 1 + weight) and an instance forward (a hook) stay."""
    llama = _llama()

    class OnePlusNorm(llama.LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    class GeluMLP(llama.LlamaMLP):
        pass

    cfg = llama.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
                            hidden_act="gelu")
    model = torch.nn.Sequential(llama.LlamaRMSNorm(8), OnePlusNorm(8), llama.LlamaRMSNorm(8), GeluMLP(cfg))
    model[2].forward = lambda x: torch.zeros_like(x)
    try:
        assert use_row_layers(model) == 1
        assert not row_layers_used(model[3])                               # not SiLU: left alone
        with torch.no_grad():
            assert torch.equal(model[:3](torch.randn(3, 8)), torch.zeros(3, 8))
    finally:
        assert restore_row_layers(model) == 1
    assert "forward" in model[2].__dict__                                 # not removed


def test_rotary_left_alone_where_it_rotates_otherwise(monkeypatch):
    """A modeling module whose apply_rotary_pos_emb has Llama's code but whose rotate_half differs
    (as NanoChat's and BLT's do) keeps its own function; so does a call with unsqueeze_dim=2."""
    import sys
    import types as pytypes
    llama = _llama()
    fake = pytypes.ModuleType("dartree_test_fake_modeling")

    def rotate_half(x):  # signs the other way round
        half = x.shape[-1] // 2
        return torch.cat([x[..., half:], -x[..., :half]], -1)

    fake.rotate_half = rotate_half
    fake.torch = torch
    original = _original_rotary()
    written = row_layers._as_written(original)  # (transformers 5.25 with kernels: inside a Func module)
    fake.apply_rotary_pos_emb = pytypes.FunctionType(written.__code__, fake.__dict__, "apply_rotary_pos_emb",
                                                     written.__defaults__)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Layer(torch.nn.Module):
        pass

    Layer.__module__ = fake.__name__
    model = torch.nn.Sequential(Layer(), llama.LlamaRMSNorm(8))
    kept = fake.apply_rotary_pos_emb
    try:
        use_row_layers(model)
        assert fake.apply_rotary_pos_emb is kept
    finally:
        restore_row_layers(model)
    # Llama's own module, called with unsqueeze_dim=2 (q, k as [B, T, H, D]): transformers' code runs
    model = tiny_target("llama", hidden=32, layers=1)
    use_row_layers(model)
    try:
        gen = torch.Generator().manual_seed(1)
        q, k = torch.randn(1, 5, 4, 8, generator=gen), torch.randn(1, 5, 2, 8, generator=gen)
        cos, sin = _tables(1, 5, 8, torch.float32, gen)
        calls = _count(monkeypatch, "rotary_tables")
        with torch.no_grad():
            got = _llama().apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        assert not calls and all(torch.equal(g, w) for g, w in zip(got, original(q, k, cos, sin, 2)))
    finally:
        restore_row_layers(model)


def test_rotary_inside_a_kernels_func_module():
    """transformers 5.25 with the kernels package exposes apply_rotary_pos_emb as a kernels ``Func``
    module calling the function it closes over: that function is what is compared; a Func whose
    forward was replaced (kernelized), or another module, is not Llama's."""
    fn = row_layers._as_written(_original_rotary())

    def make(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)
        return Func()

    wrapped = make(fn)
    assert row_layers._as_written(wrapped) is fn and row_layers._llama_rotary(wrapped)
    kernelized = make(fn)
    kernelized.forward = lambda *a, **k: None
    assert row_layers._as_written(kernelized) is None and not row_layers._llama_rotary(kernelized)
    assert row_layers._as_written(torch.nn.Identity()) is None
    assert not row_layers._llama_rotary(make(lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)))


def test_set_linear_applies_and_restores_them():
    model = tiny_target("llama", hidden=32, layers=2)
    set_linear(model, "few_rows")
    try:
        assert row_layers_used(model) and hasattr(_llama().apply_rotary_pos_emb, "_dartree_original")
    finally:
        set_linear(model, "torch")
    assert not row_layers_used(model) and not hasattr(_llama().apply_rotary_pos_emb, "_dartree_original")


@pytest.mark.parametrize("method", ["chain", "dartree", "ddtree"])
def test_bfloat16_decoding_equals_plain_decoding_through_them(method, monkeypatch):
    """bfloat16 on a CPU with every per-row kernel (linear layers, norms, rotary, attention): the
    trees' rows round as plain steps do, so a method's output equals plain decoding's."""
    from dartree_ext.attention import use_packed_attention
    from dartree_ext.models import LookupDrafter
    model = tiny_target("llama", vocab=97, hidden=64, layers=4, seed=5).to(torch.bfloat16)
    set_linear(model, "few_rows")
    try:
        assert use_packed_attention(model)
        gen = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (9, 4, 14)]
        ids, mask = left_pad(prompts)
        width = ids.shape[1]
        ar = SpeculativeDecoder(model, None, "ar").generate(ids, mask, max_new_tokens=40)
        refs = [torch.cat([p, ar.sequences[b, width:]]) for b, p in enumerate(prompts)]
        drafter = LookupDrafter(tiny_drafter(model).to(torch.bfloat16), refs, miss=0.3)
        rows = _count(monkeypatch, "rms_norm_rows")
        out = SpeculativeDecoder(model, drafter, method, budget=12, width=4, K=6).generate(ids, mask, max_new_tokens=40)
        assert out.stats.tau > 1.5 and max(r[-2] for r in rows if len(r) == 3) > 1  # trees went through the norms
        assert torch.equal(out.sequences, ar.sequences)
    finally:
        set_linear(model, "torch")


def test_mlps_keep_their_code_without_a_vector_silu(monkeypatch):
    """On a CPU where silu_mul would run its baseline build (no AVX2 + FMA), the MLPs and the
    drafter keep PyTorch's activation (that build is slower); the norms are still patched."""
    from dartree_ext import row_layers
    assert row_layers.build_info()["vector_build"] in ("avx512", "avx2", "base")
    model = tiny_target("llama", hidden=32, layers=2)
    drafter = tiny_drafter(model)
    ids = torch.randint(0, 97, (1, 6))
    monkeypatch.setattr(row_layers, "vector_silu", lambda: False)
    assert row_layers.use_row_layers(model) > 0
    kinds = {getattr(m, "_dartree_row_layer", None) for m in model.modules()}
    assert "norm" in kinds and "mlp" not in kinds
    row_layers.restore_row_layers(model)
    calls = _count(monkeypatch, "silu_mul")
    with torch.no_grad():
        drafter(ids[:, -1], torch.tensor([5]), torch.zeros(1, 0, drafter.config.hidden_size),
                torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.bool))
    assert not calls
    monkeypatch.setattr(row_layers, "vector_silu", lambda: True)
    with torch.no_grad():
        drafter(ids[:, -1], torch.tensor([5]), torch.zeros(1, 0, drafter.config.hidden_size),
                torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.bool))
    assert calls
    row_layers.use_row_layers(model)
    assert "mlp" in {getattr(m, "_dartree_row_layer", None) for m in model.modules()}
    row_layers.restore_row_layers(model)
