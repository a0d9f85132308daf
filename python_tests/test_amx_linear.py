"""amx_linear (bfloat16 through AMX tiles) against its float64 reference, its batch invariance,
pack_amx's layout, and the "amx" linear set-up of a model (decoding stays lossless)."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import ops, reference
from dartree_ext.decoding import SpeculativeDecoder
from dartree_ext.linear import amx_available, linear_kind, linear_kinds, set_linear
from models import tiny_drafter, tiny_target

needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX-BF16 tiles for this process (build_info()['amx_linear'])")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` and ``b`` (bfloat16) in units of ``b``'s last place."""
    ulp = torch.ldexp(torch.ones_like(b.float()), torch.frexp(b.float().abs().clamp(min=2 ** -100))[1] - 8)
    return float(((a.float() - b.float()).abs() / ulp).max())


def test_pack_amx_layout():
    w = torch.arange(20 * 64, dtype=torch.float32).reshape(20, 64).bfloat16()
    p = ops.pack_amx(w)
    assert p.shape == (2, 2, 512) and p.dtype == torch.bfloat16
    for nb in range(2):
        for kb in range(2):
            for r in range(16):
                for c in range(16):
                    for e in range(2):
                        n, k = nb * 16 + c, kb * 32 + 2 * r + e
                        expected = w[n, k] if n < 20 else 0
                        assert p[nb, kb, (r * 16 + c) * 2 + e] == expected


@needs_amx
@pytest.mark.parametrize("out,inp", [(16, 32), (50, 64), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_the_reference(out, inp, bias):
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    p = ops.pack_amx(w)
    for rows in (1, 3, 16, 17, 40):
        x = torch.randn(rows, inp, generator=g).bfloat16()
        y = ops.amx_linear(x, p, out, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
        # float32 sums in another order than the float64 reference: within a last place of the bfloat16
        assert _ulps(y, reference.amx_linear(x, w, b)) <= 1.0
    x = torch.randn(2, 3, inp, generator=g).bfloat16()  # leading dimensions
    assert torch.equal(ops.amx_linear(x, p, out, b), ops.amx_linear(x.reshape(6, inp), p, out, b).reshape(2, 3, out))


@needs_amx
def test_amx_linear_is_batch_invariant():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    p = ops.pack_amx(w)
    x = torch.randn(70, 96, generator=g).bfloat16()
    alone = torch.cat([ops.amx_linear(x[m:m + 1], p, 200, b) for m in range(70)])
    for rows in range(1, 71):
        assert torch.equal(ops.amx_linear(x[:rows], p, 200, b), alone[:rows]), rows
    shifted = torch.cat([torch.randn(5, 96, generator=g).bfloat16(), x[:20]])  # the rows at other positions
    assert torch.equal(ops.amx_linear(shifted, p, 200, b)[5:], alone[:20])


@needs_amx
def test_amx_linear_opcheck_and_empty():
    w = torch.randn(20, 32).bfloat16()
    p = ops.pack_amx(w)
    torch.library.opcheck(torch.ops.dartree_ext.amx_linear.default, (torch.randn(3, 32).bfloat16(), p, 20, None))
    assert ops.amx_linear(torch.randn(0, 32).bfloat16(), p, 20).shape == (0, 20)


def test_amx_linear_refuses_without_amx_or_runs():
    x, p = torch.randn(1, 32).bfloat16(), ops.pack_amx(torch.randn(16, 32).bfloat16())
    if amx_available():
        assert ops.amx_linear(x, p, 16).shape == (1, 16)
        assert "amx" in linear_kinds(tiny_target())
    else:
        with pytest.raises(RuntimeError, match="amx_linear: this CPU"):
            ops.amx_linear(x, p, 16)
        with pytest.raises(ValueError, match="linear 'amx' needs AMX-BF16"):
            set_linear(tiny_target().bfloat16(), "amx")
        assert "amx" not in linear_kinds(tiny_target())


@needs_amx
def test_a_model_on_amx_decodes_losslessly():
    target = tiny_target("llama", hidden=64, layers=2).bfloat16()
    ref = tiny_target("llama", hidden=64, layers=2).bfloat16()
    set_linear(target, "amx")
    assert linear_kind(target) == "amx"
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = target(ids).logits, ref(ids[:, :5]).logits  # 18 rows: amx; prefill-size inputs fall back
        assert torch.allclose(target(ids[:, :5]).logits.float(), b.float(), atol=0.1, rtol=0.05)
        assert a.shape == (2, 9, 97)
    drafter = tiny_drafter(target).bfloat16()
    set_linear(drafter, "amx")
    prompts = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    outs = [SpeculativeDecoder(target, drafter, m, budget=16).generate(prompts, max_new_tokens=10).sequences
            for m in ("ar", "dartree", "ddtree")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with torch.no_grad():  # a weight written in place: the packed copy follows
        layer = target.model.layers[0].mlp.down_proj
        x = torch.randn(3, layer.in_features).bfloat16()
        layer.weight.mul_(2)
        assert torch.equal(layer(x), ops.amx_linear(x, ops.pack_amx(layer.weight), layer.out_features))
    set_linear(target, "few_rows")
    assert linear_kind(target) == "few_rows"
    set_linear(target, "torch")
    assert linear_kind(target) == "torch"


@needs_amx
def test_amx_needs_bfloat16_layers():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match="bfloat16 nn.Linear layers"):
        set_linear(model, "amx")
    assert linear_kind(model) == "torch"  # refused before anything was patched
