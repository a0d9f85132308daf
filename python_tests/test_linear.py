"""few_rows_linear (the CPU linear for a verification forward's few rows) against its reference,
its batch invariance, bad input, the model patch and the measured choice of it."""
from __future__ import annotations

import os

import pytest
import torch

import dartree_ext
from dartree_ext import ops, reference
from dartree_ext.decoding import profiling as costmod
from dartree_ext.linear import (DEFAULT_MAX_ROWS, amx_available, few_rows_max_rows, linear_kind, restore_torch_linear, set_linear,
                                use_few_rows_linear)
from dartree_ext.loading import tiny_target

_FLAGS = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
HAS_AVX2 = {"avx2", "fma"} <= _FLAGS
HAS_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= _FLAGS
HAS_DOT = HAS_AVX512 and "avx512_bf16" in _FLAGS   # VDPBF16PS
OPS = {"fast": torch.ops.dartree_ext.few_rows_linear, "portable": torch.ops.dartree_ext.few_rows_linear_portable}
if HAS_AVX2:
    OPS["avx2"] = torch.ops.dartree_ext.few_rows_linear_avx2
if HAS_AVX512:
    OPS["avx512"] = torch.ops.dartree_ext.few_rows_linear_avx512
if HAS_DOT:
    OPS["avx512_bf16"] = torch.ops.dartree_ext.few_rows_linear_avx512_bf16
PATHS = list(OPS)
VECTOR_PATHS = [p for p in PATHS if p != "portable"]  # one arithmetic: the same bits (but "fast" may be portable)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    return tmp_path


def _inputs(rows, k, n, dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check_close(y, x, w, b):
    ref = reference.few_rows_linear(x, w, b).float()
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 accumulation error, then (bfloat16) one rounding of the result
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
    tol = 1e-5 * scale + (exact.abs() * 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool(((y.double() - exact).abs() <= tol).all()), (y.double() - exact).abs().max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (7, 583, 1539), (23, 64, 9), (65, 31, 4), (13, 1, 3),
                                      (6, 33, 1), (256, 40, 17)])
def test_matches_reference(path, dtype, rows, k, n):
    x, w, b = _inputs(rows, k, n, dtype, seed=rows * 1000 + k)
    _check_close(OPS[path](x, w, b), x, w, b)
    _check_close(OPS[path](x, w, None), x, w, None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(path, dtype):
    """Row m of a batch is bit-identical to that row alone, and to it inside any other batch."""
    x, w, b = _inputs(29, 583, 1031, dtype, seed=3)
    y = OPS[path](x, w, b)
    for m in range(29):
        assert torch.equal(OPS[path](x[m:m + 1], w, b), y[m:m + 1]), m
    assert torch.equal(OPS[path](x[5:22], w, b), y[5:22])
    assert torch.equal(OPS[path](x.flip(0), w, b).flip(0), y)
    assert torch.equal(OPS[path](x.view(29, 1, 583), w, b).view(29, 1031), y)   # leading dims kept
    # a weight row in another kind of block (4-row blocks shift, single rows at the end)
    for skip in (1, 2, 3, 1029):
        assert torch.equal(OPS[path](x, w[skip:], b[skip:]), y[:, skip:]), skip
    for threads in (1, 3):                                                  # another split of the rows
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(OPS[path](x, w, b), y)
        finally:
            torch.set_num_threads(before)


def test_fast_path_where_the_cpu_has_it():
    """On a CPU with AVX-512F/BW/VL the build must take the AVX-512 path (for bfloat16 the
    VDPBF16PS one where the CPU has AVX-512 BF16 and it measures faster), else with AVX2 + FMA the
    AVX2 one (else this test is the portable path twice)."""
    flags, info = _FLAGS, dartree_ext.build_info()["few_rows_linear"]
    fallback = "avx2" if HAS_AVX2 else "generic"
    assert info["float32"] == ("avx512" if "avx512f" in flags else fallback)
    bf16 = ({"avx512", "avx512_bf16"} if HAS_DOT and os.environ.get("DARTREE_FEW_ROWS_BF16") != "fma"
            else {"avx512"} if HAS_AVX512 else {fallback})
    assert info["bfloat16"] in bf16


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2 + FMA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (7, 583, 1539), (13, 1, 3), (6, 33, 1), (5, 47, 9),
                                      (64, 576, 130), (3, 1536, 576), (2, 64, 40)])
def test_vector_paths_give_the_same_bits(dtype, rows, k, n):
    """The AVX2 path runs the AVX-512 path's arithmetic lane for lane (a 16-lane accumulator as two
    8-lane halves, the same reduction), and VDPBF16PS (bfloat16) the same products in the same
    order: every vector path agrees bit for bit with the op's default, whichever this CPU takes,
    including its choice for one row (FMAs) against more (VDPBF16PS where it pays)."""
    x, w, b = _inputs(rows, k, n, dtype, seed=rows + 7 * k + n)
    for bias in (b, None):
        want = OPS["fast"](x, w, bias)
        for path in VECTOR_PATHS:
            assert torch.equal(OPS[path](x, w, bias), want), path
        for m in range(rows):
            assert torch.equal(OPS["fast"](x[m:m + 1], w, bias), want[m:m + 1]), m


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2 + FMA")
@pytest.mark.parametrize("path", [p for p in ("avx2", "avx512", "avx512_bf16") if p in OPS])
def test_vector_paths_sum_in_the_documented_order(path):
    """Each output is 16 lane sums over k = l mod 16 (bfloat16: within each 32-block lane l takes
    input 2l + 1, then 2l, VDPBF16PS's order; then plain order in the tail), added halves-pairwise:
    rebuilt here in float32 with fused multiply-adds from float64 products rounded once, which is
    what an FMA does (and what VDPBF16PS does with each of its two products)."""
    gen = torch.Generator().manual_seed(11)
    for dtype, k in ((torch.float32, 37), (torch.float32, 64), (torch.bfloat16, 75), (torch.bfloat16, 64),
                     (torch.bfloat16, 50)):
        x = torch.randn(3, k, generator=gen).to(dtype)
        w = torch.randn(2, k, generator=gen).to(dtype)
        got = OPS[path](x, w, None).float()
        order = list(range(k))
        if dtype == torch.bfloat16:   # lane of input index i: interleaved 32-blocks, then plain
            pairs = k // 32 * 32
            lane = [((i % 32) // 2 if i < pairs else i % 16) for i in range(k)]
            order = [i ^ 1 if i < pairs else i for i in range(k)]   # each pair: odd, then even
        else:
            lane = [i % 16 for i in range(k)]
        for m in range(3):
            for n in range(2):
                acc = [0.0] * 16
                for i in order:   # this order within each lane; an FMA rounds acc + x * w once
                    prod = float(x[m, i].double() * w[n, i].double())
                    acc[lane[i]] = float(torch.tensor(acc[lane[i]] + prod, dtype=torch.float64).float())
                v = torch.tensor(acc, dtype=torch.float32)
                s8 = v[:8] + v[8:]
                s4 = s8[:4] + s8[4:]
                s2 = s4[:2] + s4[2:]
                s1 = s2[0] + s2[1]
                want = s1.to(dtype).float()
                assert torch.equal(got[m, n], want), (dtype, k, m, n, got[m, n].item(), want.item())


def test_hand_built():
    eye = torch.eye(40)
    x = torch.randn(5, 40)
    assert torch.equal(ops.few_rows_linear(x, eye), x)                   # exact: one product per sum
    assert torch.equal(ops.few_rows_linear(x.bfloat16(), eye.bfloat16()), x.bfloat16())
    ones = torch.ones(3, 40)
    assert torch.equal(ops.few_rows_linear(ones, torch.ones(2, 40), torch.tensor([1.0, -1.0])),
                       torch.tensor([[41.0, 39.0]] * 3))
    assert ops.few_rows_linear(torch.randn(0, 40), eye).shape == (0, 40)
    assert torch.equal(ops.few_rows_linear(torch.randn(3, 0), torch.randn(2, 0), torch.tensor([1.0, 2.0])),
                       torch.tensor([[1.0, 2.0]] * 3))                   # K = 0: the bias
    v = torch.randn(40)
    assert torch.equal(ops.few_rows_linear(v, eye), v)                  # 1-D x
    wide = torch.randn(5, 80)[:, ::2]                                   # non-contiguous x
    assert torch.equal(ops.few_rows_linear(wide, eye), ops.few_rows_linear(wide.contiguous(), eye))


def test_bad_input():
    x, w, b = _inputs(4, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.few_rows_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.few_rows_linear(x.half(), w.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.few_rows_linear(x, torch.randn(16, 8).T)
    with pytest.raises(RuntimeError, match="features"):
        ops.few_rows_linear(torch.randn(4, 15), w)
    with pytest.raises(ValueError, match=r"x has \d+ rows, at most 256"):
        ops.few_rows_linear(torch.randn(257, 16), w)
    with pytest.raises(RuntimeError, match="bias"):
        ops.few_rows_linear(x, w, torch.randn(7))
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.few_rows_linear(x, w, torch.randn(8, dtype=torch.float64))


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path):
    x, w, b = _inputs(5, 24, 12, torch.float32)
    torch.library.opcheck(OPS[path].default, (x, w, b))
    torch.library.opcheck(OPS[path].default, (x.bfloat16(), w.bfloat16(), None))


@pytest.mark.parametrize("path", PATHS)
def test_bad_input_every_path(path):
    """Every path shares the op's checks: the same clear errors."""
    x, w, _ = _inputs(4, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="weight must be"):
        OPS[path](x, w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="features"):
        OPS[path](torch.randn(4, 15), w, None)
    with pytest.raises(ValueError, match=r"x has \d+ rows, at most 256"):
        OPS[path](torch.randn(257, 16), w, None)


def test_build_info_names_the_path():
    info = dartree_ext.build_info()["few_rows_linear"]
    assert set(info) == {"float32", "bfloat16"} and set(info.values()) <= {"avx512", "avx512_bf16", "avx2", "generic"}
    assert info["float32"] != "avx512_bf16"


@pytest.mark.skipif(not HAS_AVX512, reason="needs AVX-512")
def test_bf16_path_choice_from_the_environment(tmp_path):
    """DARTREE_FEW_ROWS_BF16 picks FMAs or VDPBF16PS for bfloat16 (read once per process); a bad
    value is a clear error at the first bfloat16 call."""
    import subprocess
    import sys
    code = ("import torch, dartree_ext; from dartree_ext import ops; "
            "ops.few_rows_linear(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(3, 8, dtype=torch.bfloat16)); "
            "print(dartree_ext.build_info()['few_rows_linear']['bfloat16'])")

    def run(value):  # -P, elsewhere: the installed package, not the source tree (which has no _C when installed)
        env = dict(os.environ, DARTREE_FEW_ROWS_BF16=value)
        return subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    fma = run("fma")
    assert fma.returncode == 0 and fma.stdout.split()[-1] == "avx512", fma.stderr
    if HAS_DOT:
        dot = run("dot")
        assert dot.returncode == 0 and dot.stdout.split()[-1] == "avx512_bf16", dot.stderr
    bad = run("fast")
    assert bad.returncode != 0 and "DARTREE_FEW_ROWS_BF16 must be dot, fma or auto" in bad.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_model(dtype):
    model = tiny_target(dtype=dtype)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        assert use_few_rows_linear(model, max_rows=32) == 4 * 7 + 1 and linear_kind(model) == "few_rows"
        assert few_rows_max_rows(model) == 32
        calls = []
        real = ops.few_rows_linear
        try:
            ops.few_rows_linear = lambda *a: calls.append(a[0].shape) or real(*a)
            patched = model(ids).logits
            assert len(calls) == 29                                       # every layer, 18 rows
            calls.clear()
            assert model(torch.randint(0, 256, (2, 17))).logits.shape[:2] == (2, 17)
            assert not calls                                             # 34 rows > 32: torch's GEMM
        finally:
            ops.few_rows_linear = real
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(patched.float(), before.float(), atol=tol, rtol=tol)
    assert restore_torch_linear(model) == 29 and linear_kind(model) == "torch"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_patched_model_keeps_autograd():
    model = tiny_target()
    use_few_rows_linear(model)
    loss = model(torch.randint(0, 256, (1, 5))).logits.sum()
    loss.backward()                                                       # F.linear while grads are needed
    assert all(p.grad is not None for p in model.lm_head.parameters())
    layer = torch.nn.Linear(6, 3)
    layer.weight.requires_grad_(False)                                    # only the bias trains
    use_few_rows_linear(layer)
    layer(torch.randn(2, 6)).sum().backward()
    assert layer.bias.grad is not None and torch.equal(layer.bias.grad, torch.full((3,), 2.0))


def test_patch_leaves_other_linears_alone():
    class Scaled(torch.nn.Linear):                                       # a subclass with its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled(4, 4), torch.nn.Linear(4, 4))
    hooked = model[2]
    hooked.forward = lambda x: torch.zeros(x.shape[0], 4)                 # an instance forward (a hook)
    assert use_few_rows_linear(model) == 1 and linear_kind(model[1]) == "torch"
    with torch.no_grad():
        assert torch.equal(model(torch.randn(3, 4)), torch.zeros(3, 4))
    restore_torch_linear(model)
    assert "forward" in hooked.__dict__                                   # not removed
    with pytest.raises(ValueError, match="max_rows"):
        use_few_rows_linear(model, max_rows=0)
    with pytest.raises(ValueError, match="linear must be"):
        set_linear(model, "fast")


def test_greedy_decoding_lossless_with_few_rows():
    """Plain decoding and every tree method share the patched target: T = 0 outputs are equal."""
    from dartree_ext.decoding.decoder import SpeculativeDecoder
    from dartree_ext.models import BlockDrafter
    target = tiny_target()
    use_few_rows_linear(target)
    torch.manual_seed(1)
    drafter = BlockDrafter.from_target(target).eval()
    prompts = torch.randint(1, 256, (2, 12))
    ref = SpeculativeDecoder(target, None, "ar").generate(prompts, max_new_tokens=24).sequences
    rows = []
    real = ops.few_rows_linear
    try:
        ops.few_rows_linear = lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a)
        for method in ("chain", "dartree", "ddtree"):
            out = SpeculativeDecoder(target, drafter, method, budget=16).generate(prompts, max_new_tokens=24)
            assert torch.equal(out.sequences, ref), method
    finally:
        ops.few_rows_linear = real
    assert max(rows) > 2                                                  # the trees went through the op
    assert DEFAULT_MAX_ROWS >= 65                                         # a 64-node tree and its root


def _fake_forward_times(monkeypatch, times: dict) -> list:
    """``forward_ms`` answers ``times[(dtype, linear)]``; returns the list of its calls' tokens."""
    calls = []

    def fake_forward(model, tokens, reps, context=64):
        calls.append(tokens)
        return times[(next(model.parameters()).dtype, linear_kind(model))]

    monkeypatch.setattr(costmod, "forward_ms", fake_forward)
    return calls


def test_choose_forward_is_cached_and_keyed(cache_dir, monkeypatch):
    calls = _fake_forward_times(monkeypatch, {(torch.float32, "torch"): 5.0, (torch.bfloat16, "torch"): 3.0,
                                              (torch.float32, "few_rows"): 4.0, (torch.bfloat16, "few_rows"): 2.0})
    target = tiny_target()
    dtype, linear, ms = costmod.choose_forward(target, tokens=(1, 9), reps=1)
    assert (dtype, linear) == (torch.bfloat16, "few_rows")
    assert ms == {"float32": 10.0, "float32+few_rows": 8.0, "bfloat16": 6.0, "bfloat16+few_rows": 4.0}
    assert linear_kind(target) == "torch" and next(target.parameters()).dtype == torch.float32  # untouched
    use_few_rows_linear(target, max_rows=7)
    costmod.choose_forward(target, tokens=(1, 9), reps=1, refresh=True)
    assert few_rows_max_rows(target) == 7                                 # restored as it was
    restore_torch_linear(target)
    calls.clear()
    assert costmod.choose_forward(target, tokens=(1, 9), reps=1)[:2] == (torch.bfloat16, "few_rows")
    assert len(calls) == 0                                                # cached
    # torch's linear only: a different cache entry (the dtype choice of before)
    assert costmod.choose_dtype(target, tokens=(1, 9), reps=1) == (torch.bfloat16, {"float32": 10.0, "bfloat16": 6.0})
    assert len(calls) == 4
    assert costmod.choose_forward(target, (torch.float32,), tokens=(1, 9), reps=1)[:2] == (torch.float32, "few_rows")
    with pytest.raises(ValueError, match="linears"):
        costmod.choose_forward(target, linears=("fast",))


def test_resolve_forward_applies_the_set_up(cache_dir, monkeypatch):
    """What dartree-generate and bench/e2e/e2e.py do with --dtype / --linear: explicit choices are
    applied without measuring, "auto" takes choose_forward's pick, bad names are refused."""
    calls = _fake_forward_times(monkeypatch, {(torch.float32, "torch"): 5.0, (torch.bfloat16, "torch"): 3.0,
                                              (torch.float32, "few_rows"): 4.0, (torch.bfloat16, "few_rows"): 6.0,
                                              (torch.bfloat16, "amx"): 7.0})
    model, dtype, linear, ms = costmod.resolve_forward(tiny_target(), "float32", "few_rows")
    assert (dtype, linear, ms, calls) == (torch.float32, "few_rows", {}, [])
    assert linear_kind(model) == "few_rows" and next(model.parameters()).dtype == torch.float32
    model, dtype, linear, ms = costmod.resolve_forward(tiny_target(), "auto", "auto")
    # amx is measured in bfloat16 only, where this process has AMX tiles
    assert (dtype, linear) == (torch.bfloat16, "torch") and calls and set(ms) == {
        "float32", "float32+few_rows", "bfloat16", "bfloat16+few_rows"} | ({"bfloat16+amx"} if amx_available() else set())
    assert linear_kind(model) == "torch" and next(model.parameters()).dtype == torch.bfloat16
    model, dtype, linear, _ = costmod.resolve_forward(tiny_target(), torch.float32, "auto")
    assert (dtype, linear) == (torch.float32, "few_rows") and linear_kind(model) == "few_rows"
    with pytest.raises(ValueError, match="dtype"):
        costmod.resolve_forward(tiny_target(), "float16", "torch")
    with pytest.raises(ValueError, match="linear"):
        costmod.resolve_forward(tiny_target(), "float32", "fast")


def test_cost_key_names_the_linear():
    target = tiny_target()
    key = costmod.cost_key(target, None, "cpu", [0, 1], [64], ["dartree"])
    use_few_rows_linear(target)
    paths = dartree_ext.build_info()["few_rows_linear"]   # a new kernel path is a new entry
    assert costmod.cost_key(target, None, "cpu", [0, 1], [64], ["dartree"]) == dict(key, linear="few_rows",
                                                                                    few_rows_linear=paths)
    set_linear(target, "few_rows")                          # and the row layers with them: another entry
    try:
        assert costmod.cost_key(target, None, "cpu", [0, 1], [64], ["dartree"]) == dict(
            key, linear="few_rows", few_rows_linear=paths, row_layers=True)
    finally:
        set_linear(target, "torch")


def test_cost_key_names_the_drafters_linear():
    from dartree_ext.models import BlockDrafter
    target = tiny_target()
    drafter = BlockDrafter.from_target(target).eval()
    key = costmod.cost_key(target, drafter, "cpu", [0, 1], [64], ["dartree"])
    use_few_rows_linear(drafter)
    assert costmod.cost_key(target, drafter, "cpu", [0, 1], [64], ["dartree"]) == dict(
        key, drafter_linear="few_rows", few_rows_linear=dartree_ext.build_info()["few_rows_linear"])


def test_linear_as_follows_the_layer(monkeypatch):
    """linear_as runs few_rows_linear only where the layer is patched and the call qualifies."""
    layer = torch.nn.Linear(32, 8)
    x, w, b = _inputs(3, 32, 40, torch.float32)
    calls = []
    real = ops.few_rows_linear
    monkeypatch.setattr(ops, "few_rows_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    from dartree_ext.linear import linear_as
    torch.testing.assert_close(linear_as(layer, x, w, b), torch.nn.functional.linear(x, w, b))
    assert calls == []                                                    # not patched: F.linear
    use_few_rows_linear(layer, max_rows=3)
    _check_close(linear_as(layer, x, w, b), x, w, b)
    assert calls == [x.shape]
    linear_as(layer, torch.cat([x, x]), w, b)                             # 6 rows > max_rows: F.linear
    assert len(calls) == 1


@pytest.mark.parametrize("patched", [False, True])
def test_load_drafter_follows_the_targets_linear(patched, monkeypatch):
    """A drafter loaded for a patched target runs its layers and its draft-vocabulary head through
    few_rows_linear; its drafts equal the unpatched drafter's up to rounding."""
    from dartree_ext.loading import load_drafter
    target = tiny_target()
    if patched:
        use_few_rows_linear(target, max_rows=40)
    drafter = load_drafter(None, target).set_draft_vocab(list(range(0, 256, 2)))
    assert linear_kind(drafter) == ("few_rows" if patched else "torch")
    assert few_rows_max_rows(drafter) == (40 if patched else None)
    shapes = []
    real = ops.few_rows_linear
    monkeypatch.setattr(ops, "few_rows_linear", lambda x, *a: shapes.append(tuple(a[0].shape)) or real(x, *a))
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 6, target.config.hidden_size * len(drafter.config.target_layer_ids), generator=gen)
    args = (torch.tensor([5, 7]), torch.tensor([6, 6]))
    rest = (torch.arange(6)[None].expand(2, -1), torch.ones(2, 6, dtype=torch.bool))
    with torch.no_grad():
        out = drafter(*args, drafter.project_context(features), *rest)
        restore_torch_linear(drafter)
        ref = drafter(*args, drafter.project_context(features), *rest)
    head = (128, target.config.hidden_size)                               # the draft vocabulary's rows
    assert (head in shapes) == patched and bool(shapes) == patched
    torch.testing.assert_close(out.base_logits, ref.base_logits, atol=1e-4, rtol=1e-4)
