"""The VAT loss (dartree_ext.vat) against the PyTorch reference on every backend (CPU kernels, the CUDA
kernels under emulation, real CUDA): values and gradients for every schedule and both rules,
hand-built blocks, gradcheck, the sampling rule's acceptance rate, the chunked linear variant,
opcheck and bad input."""
from __future__ import annotations

import math

import pytest
import torch

import dartree_ext
from dartree_ext import reference, vat
from conftest import cuda_available

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])


def api(backend):
    """vat_loss / vat_loss_linear on the backend (the emulated backend composes its own kernels)."""
    return backend.ops if backend.name == "emu" else vat


def make_inputs(m, k, vocab, dtype=torch.float32, seed=0, noise=1.0, with_vh=True):
    """Blocks where the draft is the target plus noise (so acceptance is mixed), a trailing invalid
    position in every other block, one fully invalid block (when m >= 3), NaN logits there."""
    gen = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(m, k, vocab, generator=gen, dtype=torch.float64)
    draft = target + noise * torch.randn(m, k, vocab, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (m, k), generator=gen)
    valid = torch.ones(m, k, dtype=torch.bool)
    valid[::2, k - 1] = False
    if m >= 3:
        valid[1] = False
        draft[1, 0] = float("nan")  # invalid positions may hold anything
        tokens[1, 0] = -100
    vh = torch.randn(m, k, generator=gen, dtype=torch.float64) if with_vh else None
    return draft.to(dtype), target.to(dtype), tokens, (vh.to(dtype) if with_vh else None), valid


def tolerances(dtype):
    return {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-3, 2e-3),
            torch.float16: (2e-3, 2e-3)}[dtype]


def run_both(backend, inputs, **options):
    """(ours, reference) with gradients of the draft logits and vh logits."""
    draft, target, tokens, vh, valid = inputs
    results = []
    for fn, dev in ((api(backend).vat_loss, backend.device), (reference.vat_loss, torch.device("cpu"))):
        # fresh leaves every call: on the CPU .to() returns the input itself, and marking it would
        # make the next call's copy to a GPU a non-leaf without .grad
        d = draft.detach().to(dev).clone().requires_grad_(True)
        h = None if vh is None else vh.detach().to(dev).clone().requires_grad_(True)
        opts = {key: v.to(dev) if isinstance(v, torch.Tensor) else v for key, v in options.items()}
        if "seed" in opts:
            opts["generator"] = torch.Generator().manual_seed(opts.pop("seed"))
        out = fn(d, target.to(dev), tokens.to(dev), h, valid.to(dev), **opts)
        out.loss.backward()
        results.append((out, d.grad, None if h is None else h.grad))
    return results


@pytest.mark.parametrize("schedule", vat.SCHEDULES)
@pytest.mark.parametrize("rule", ["greedy", "sample"])
def test_matches_reference_every_schedule(backend, schedule, rule):
    inputs = make_inputs(4, 5, 300, seed=len(schedule))
    (ours, g_ours, gh_ours), (ref, g_ref, gh_ref) = run_both(
        backend, inputs, rule=rule, schedule=schedule, temperature=0.8, decay_gamma=3.0, vh_weight=0.5, seed=7)
    assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
    assert torch.equal(ours.accept.cpu(), ref.accept)
    torch.testing.assert_close(ours.weights.cpu(), ref.weights, rtol=1e-6, atol=1e-7)
    for name in ("loss", "ce_loss", "vh_loss"):
        torch.testing.assert_close(getattr(ours, name).cpu(), getattr(ref, name), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(g_ours.cpu(), g_ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(gh_ours.cpu(), gh_ref, rtol=2e-5, atol=1e-6)
    # the inputs exercise both outcomes, and invalid positions get no gradient
    assert 0 < float(ref.accept[inputs[4]].mean()) < 1
    assert float(g_ours.cpu()[~inputs[4]].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 64, 1000])
def test_matches_reference_dtypes_and_vocab_sizes(backend, dtype, vocab):
    inputs = make_inputs(3, 4, vocab, dtype=dtype, seed=vocab)
    for rule in ("greedy", "sample"):
        (ours, g_ours, gh_ours), (ref, g_ref, gh_ref) = run_both(backend, inputs, rule=rule, seed=vocab)
        rtol, atol = tolerances(dtype)
        assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
        torch.testing.assert_close(ours.loss.cpu(), ref.loss, rtol=rtol, atol=atol)
        assert ours.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert g_ours.dtype == dtype
        torch.testing.assert_close(g_ours.cpu().double(), g_ref.double(), rtol=max(rtol, 1e-2 if dtype in (
            torch.bfloat16, torch.float16) else rtol), atol=max(atol, 1e-4 if dtype != torch.float64 else atol))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocabulary(backend, dtype):
    """V = 49152 (SmolLM2's vocabulary): many tiles of the sampling scan, long per-thread sums."""
    inputs = make_inputs(2, 3, 49152, dtype=dtype, seed=9, noise=0.3)
    for rule in ("greedy", "sample"):
        (ours, g_ours, _), (ref, g_ref, _) = run_both(backend, inputs, rule=rule, temperature=1.3, seed=4)
        assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
        torch.testing.assert_close(ours.loss.cpu(), ref.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_ours.cpu().float(), g_ref.float(), rtol=1e-2, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_vocabulary_and_underflow(backend, dtype):
    """-inf logits (a vocabulary mask shared by draft and target, as for padded vocabularies) add
    nothing and get exactly zero gradient; logits ~1e4 below the maximum (exp underflows to 0) add
    nothing either; the CPU kernels' polynomial exp and chunked float sums match the reference
    across a 1000-wide row with both, for both rules and a non-unit temperature."""
    draft, target, tokens, vh, valid = make_inputs(3, 4, 1000, dtype=torch.float64, seed=5, noise=0.5)
    masked = torch.zeros(1000, dtype=torch.bool)
    masked[::7] = True
    masked[990:] = True
    draft[..., masked], target[..., masked] = float("-inf"), float("-inf")
    draft[..., 3::11] -= 1e4
    target[..., 5::13] -= 1e4
    tokens = torch.where(masked[tokens], 1, tokens)
    inputs = (draft.to(dtype), target.to(dtype), tokens, vh.to(dtype), valid)
    for rule in ("greedy", "sample"):
        (ours, g_ours, _), (ref, g_ref, _) = run_both(backend, inputs, rule=rule, temperature=0.7, seed=3)
        assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
        assert torch.equal(ours.accept.cpu(), ref.accept)
        assert torch.isfinite(ours.loss)
        torch.testing.assert_close(ours.loss.cpu(), ref.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_ours.cpu().float(), g_ref.float(), rtol=1e-2, atol=1e-6)
        assert float(g_ours.cpu()[..., masked].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rising_maxima_and_masked_prefix(backend, dtype):
    """Rows 2000 wide (several of the CPU kernels' 512-value chunks, which take maxima and sums in
    one pass and rescale the sums when a maximum rises): a rising ramp puts each row's maximum in
    its last chunk, a falling one in its first; a -inf run longer than a chunk opens every row; tied
    maxima in two chunks (the first index must win, as torch.argmax's does)."""
    draft, target, tokens, vh, valid = make_inputs(3, 4, 2000, dtype=torch.float64, seed=11, noise=0.5)
    ramp = torch.linspace(0.0, 30.0, 2000, dtype=torch.float64)
    draft[0], target[0] = draft[0] + ramp, target[0] + ramp
    draft[2], target[2] = draft[2] + ramp.flip(0), target[2] + ramp.flip(0)
    draft[..., :700], target[..., :700] = float("-inf"), float("-inf")
    draft[0, 1, [900, 1700]] = target[0, 1, [900, 1700]] = 100.0  # a tie: argmax 900 on both sides
    target[0, 2, [800, 1900]] = 100.0                             # target ties, draft's max elsewhere
    draft[0, 2, 1950] = 100.0
    tokens = tokens.clamp(min=700)
    inputs = (draft.to(dtype), target.to(dtype), tokens, vh.to(dtype), valid)
    for rule, temperature in (("greedy", 1.0), ("sample", 0.7)):
        (ours, g_ours, _), (ref, g_ref, _) = run_both(backend, inputs, rule=rule, temperature=temperature, seed=2)
        assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
        assert torch.equal(ours.accept.cpu(), ref.accept)
        torch.testing.assert_close(ours.loss.cpu(), ref.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_ours.cpu().float(), g_ref.float(), rtol=1e-2, atol=1e-6)
        assert float(g_ours.cpu()[..., :700].abs().max()) == 0.0
        if rule == "greedy":
            assert bool(ours.accept.cpu()[0, 1]) and not bool(ours.accept.cpu()[0, 2])


def test_hand_built_blocks(backend):
    """Greedy acceptance chosen position by position: draft and target argmaxes agree where 1."""
    k, vocab, gamma = 6, 8, 2.0
    pattern = torch.tensor([[1, 1, 0, 1, 0, 1],   # k* = 3
                            [1, 1, 1, 1, 1, 1],   # k* = 7
                            [0, 1, 1, 1, 1, 1],   # k* = 1
                            [1, 0, 1, 0, 1, 1]])  # position 2 invalid: k* = 4
    valid = torch.ones(4, k, dtype=torch.bool)
    valid[3, 1] = False
    valid[3, 5] = False
    target = torch.full((4, k, vocab), -1.0)
    target[..., 2] = 3.0  # target argmax 2 everywhere
    draft = torch.zeros(4, k, vocab)
    draft[..., 5] = 1.0
    draft[..., 2] = torch.where(pattern.bool(), 2.0, 0.5)  # argmax 2 where accepted, else 5
    tokens = torch.full((4, k), 2)
    expected_first = torch.tensor([3, 7, 1, 4], dtype=torch.int32)
    position = torch.arange(1, k + 1, dtype=torch.float64)
    expected_weights = {
        "vat": lambda s: torch.where(position < s, 1.0, torch.exp(-(position - s) / gamma)),
        "dflash": lambda s: torch.exp(-(position - 1) / gamma),
        "prefix_only": lambda s: (position < s).double(),
        "hard_cutoff": lambda s: (position <= s).double(),
        "unshifted": lambda s: torch.where(position < s, 1.0, torch.exp(-(position - 1) / gamma)),
        "vat_soft": lambda s: torch.where(position < s, 1.0, torch.exp(-(position - s) / gamma)),
    }
    assert set(expected_weights) == set(vat.SCHEDULES)
    log_q = torch.log_softmax(draft.double(), -1)
    p = torch.softmax(target.double(), -1)
    ce_soft = -(p * log_q).sum(-1)
    ce_hard = -log_q[..., 2]
    for schedule, rule in expected_weights.items():
        out = api(backend).vat_loss(*backend.put(draft, target, tokens), None, valid.to(backend.device),
                                    schedule=schedule, decay_gamma=gamma)
        assert out.first_reject.cpu().tolist() == expected_first.tolist()
        assert torch.equal(out.accept.cpu(), torch.where(valid, pattern.float(), 0.0))
        weights = torch.stack([rule(float(s)) for s in expected_first]) * valid
        torch.testing.assert_close(out.weights.cpu().double(), weights, rtol=1e-6, atol=1e-7)
        terms = {"dflash": ce_hard, "vat_soft": ce_soft}.get(schedule, ce_soft + ce_hard)
        expected_ce = float((weights * terms).sum() / 4)
        assert math.isclose(float(out.ce_loss), expected_ce, rel_tol=1e-5)
        assert float(out.vh_loss) == 0.0 and math.isclose(float(out.loss), expected_ce, rel_tol=1e-5)
    # the vh target is v_k = 1 iff k < k*: logits of +-30 matching it give a loss of about 0
    vh = torch.where(position[None, :] < expected_first[:, None], 30.0, -30.0).float()
    out = api(backend).vat_loss(*backend.put(draft, target, tokens, vh), valid.to(backend.device))
    assert float(out.vh_loss) < 1e-10
    out = api(backend).vat_loss(*backend.put(draft, target, tokens, -vh), valid.to(backend.device))
    assert math.isclose(float(out.vh_loss), 30.0, rel_tol=1e-6)


@pytest.mark.parametrize("schedule", ["vat", "dflash", "hard_cutoff"])
@pytest.mark.parametrize("rule", ["greedy", "sample"])
def test_gradcheck(backend, rule, schedule):
    draft, target, tokens, vh, valid = make_inputs(3, 3, 9, dtype=torch.float64, seed=3)
    draft[1, 0] = 0.0  # gradcheck perturbs every entry, also invalid ones: keep them finite
    draft, target, tokens, vh, valid = backend.put(draft, target, tokens, vh, valid)
    fn = api(backend).vat_loss

    def loss(d, h):
        return fn(d, target, tokens, h, valid, rule=rule, schedule=schedule, temperature=0.7,
                  generator=torch.Generator().manual_seed(1)).loss

    assert torch.autograd.gradcheck(loss, (draft.requires_grad_(True), vh.requires_grad_(True)))


@pytest.mark.parametrize("sample", [False, True])
def test_gradcheck_row_op_outputs(backend, sample):
    """Each differentiable output of the row op on its own: ce_soft, ce_hard and draft_lse."""
    gen = torch.Generator().manual_seed(2)
    draft, target = (torch.randn(5, 11, generator=gen, dtype=torch.float64) for _ in range(2))
    tokens = torch.randint(0, 11, (5,), generator=gen)
    uniforms = torch.rand(5, 2, generator=gen) if sample else None
    draft, target, tokens = backend.put(draft, target, tokens)
    uniforms = None if uniforms is None else uniforms.to(backend.device)
    if backend.name == "emu":
        from emulated import EmulatedVatKernels
        kernels = EmulatedVatKernels(backend.ops)
        row_forward = kernels.row_forward_differentiable
    else:
        row_forward = torch.ops.dartree_ext.vat_row_forward
    for output in (0, 1, 3):
        def fn(d):
            return row_forward(d, target, tokens, uniforms, 0.7)[output]
        assert torch.autograd.gradcheck(fn, (draft.clone().requires_grad_(True),))


def test_gradient_formula(backend):
    """d ce_loss / d draft = w (2 q - p - onehot(y)) / #blocks, written out."""
    draft, target, tokens, _, valid = make_inputs(3, 4, 50, dtype=torch.float64, seed=5)
    draft[1, 0] = 0.0
    d = backend.put(draft).requires_grad_(True)
    out = api(backend).vat_loss(d, *backend.put(target, tokens), None, valid.to(backend.device))
    (2.5 * out.ce_loss).backward()
    q, p = torch.softmax(draft, -1), torch.softmax(target, -1)
    onehot = torch.nn.functional.one_hot(tokens.clamp(min=0), 50).double()
    w = out.weights.cpu().double()[..., None]
    expected = 2.5 * w * (2 * q - p - onehot) / 2  # blocks 0 and 2 have valid positions
    torch.testing.assert_close(d.grad.cpu(), expected, rtol=1e-10, atol=1e-12)


def _accept_rate_case(rows_per_pair, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    pairs, vocab = 8, 40
    target = 2.5 * torch.randn(pairs, vocab, generator=gen, dtype=torch.float64)
    draft = target + 1.5 * torch.randn(pairs, vocab, generator=gen, dtype=torch.float64)
    p = torch.softmax(target / temperature, -1)
    q = torch.softmax(draft / temperature, -1)
    rate = torch.minimum(p, q).sum(-1)  # P(accept) of speculative sampling, per pair
    draft_rows = draft.repeat_interleave(rows_per_pair, 0)[:, None].float().contiguous()
    target_rows = target.repeat_interleave(rows_per_pair, 0)[:, None].float().contiguous()
    return draft_rows, target_rows, rate


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sample_rule_accept_rate(backend, temperature):
    """Mean acceptance over many rows vs sum_x min(p_T(x), q_T(x)), within 5 standard deviations of
    the mean of independent Bernoullis. The temperature must matter: the T = 1 rates are far outside
    the T = 0.5 tolerance (checked), so a kernel that ignored T would fail."""
    rows_per_pair = 256 if backend.name == "emu" else 2500
    draft, target, rate = _accept_rate_case(rows_per_pair, temperature, seed=11)
    n = draft.shape[0]
    tokens = torch.zeros(n, 1, dtype=torch.int64)
    valid = torch.ones(n, 1, dtype=torch.bool)
    out = api(backend).vat_loss(*backend.put(draft, target, tokens), None, valid.to(backend.device), rule="sample",
                                temperature=temperature, generator=torch.Generator().manual_seed(5))
    expected = float(rate.mean())
    sigma = math.sqrt(float((rate * (1 - rate)).sum()) * rows_per_pair) / n
    observed = float(out.accept.double().mean())
    assert abs(observed - expected) < 5 * sigma, (observed, expected, sigma)
    _, _, other_rate = _accept_rate_case(rows_per_pair, 1.5 - temperature, seed=11)
    assert abs(float(other_rate.mean()) - expected) > 10 * sigma  # the test can tell temperatures apart
    # and per (p, q) pair, each within 5 of its own standard deviations
    per_pair = out.accept.double().cpu().view(-1, rows_per_pair).mean(1)
    pair_sigma = (rate * (1 - rate) / rows_per_pair).sqrt()
    assert bool(((per_pair - rate).abs() < 5 * pair_sigma).all()), (per_pair, rate)


def test_sample_rule_is_deterministic_given_generator(backend):
    inputs = make_inputs(3, 4, 100, seed=2)
    draft, target, tokens, vh, valid = backend.put(*inputs)

    def run(seed):
        return api(backend).vat_loss(draft, target, tokens, vh, valid, rule="sample",
                                     generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.accept, b.accept) and torch.equal(a.loss, b.loss)
    assert not torch.equal(a.accept, c.accept)  # 30 valid positions: other uniforms, other decisions


def _linear_inputs(m, k, vocab, hd, ht, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    h_t = torch.randn(m, k, ht, generator=gen, dtype=torch.float64)
    w_t = torch.randn(vocab, ht, generator=gen, dtype=torch.float64) / math.sqrt(ht) * 3
    h_d = torch.randn(m, k, hd, generator=gen, dtype=torch.float64)
    w_d = torch.randn(vocab, hd, generator=gen, dtype=torch.float64) / math.sqrt(hd) * 3
    tokens = torch.randint(0, vocab, (m, k), generator=gen)
    valid = torch.ones(m, k, dtype=torch.bool)
    valid[-1, k // 2:] = False
    vh = torch.randn(m, k, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (h_d, w_d, h_t, w_t)] + [tokens, vh.to(dtype), valid]


@pytest.mark.parametrize("chunk_size", [None, 4, 9, 1000])
@pytest.mark.parametrize("rule, schedule", [("greedy", "vat"), ("sample", "dflash"), ("greedy", "unshifted"),
                                            ("sample", "vat_soft")])
def test_linear_equals_materialized(backend, chunk_size, rule, schedule):
    h_d, w_d, h_t, w_t, tokens, vh, valid = backend.put(*_linear_inputs(5, 4, 150, 12, 10, torch.float64, seed=4))
    options = dict(rule=rule, schedule=schedule, temperature=0.9)
    leaves = [t.clone().requires_grad_(True) for t in (h_d, w_d, vh)]
    out = api(backend).vat_loss_linear(leaves[0], leaves[1], h_t, w_t, tokens, leaves[2], valid,
                                       generator=torch.Generator().manual_seed(3), chunk_size=chunk_size, **options)
    (3.0 * out.loss).backward()
    mats = [t.clone().requires_grad_(True) for t in (h_d, w_d, vh)]
    expected = api(backend).vat_loss(mats[0] @ mats[1].t(), h_t @ w_t.t(), tokens, mats[2], valid,
                                     generator=torch.Generator().manual_seed(3), **options)
    (3.0 * expected.loss).backward()
    for name in ("loss", "ce_loss", "vh_loss"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name), rtol=1e-10, atol=1e-12)
    for name in ("first_reject", "accept", "weights"):
        assert torch.equal(getattr(out, name), getattr(expected, name)), name
    for ours, ref in zip(leaves, mats):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-9, atol=1e-12)


def _draft_vocab_inputs(m, k, vocab, sub, seed, dtype=torch.float64):
    """Full-vocabulary target logits, draft logits over ``sub`` of the ``vocab`` ids (unsorted), labels
    of which about a third fall outside them, and target argmaxes in and out of them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:sub]
    target = 2.0 * torch.randn(m, k, vocab, generator=gen, dtype=torch.float64)
    target[0, :, ids[3]] += 20.0                                   # block 0: the argmax is in V'
    draft = target[..., ids] + 0.5 * torch.randn(m, k, sub, generator=gen, dtype=torch.float64)
    inside = ids[torch.randint(0, sub, (m, k), generator=gen)]
    outside = torch.randint(0, vocab, (m, k), generator=gen)
    tokens = torch.where(torch.rand(m, k, generator=gen) < 0.6, inside, outside)
    valid = torch.ones(m, k, dtype=torch.bool)
    valid[-1, k - 1] = False
    vh = torch.randn(m, k, generator=gen, dtype=torch.float64)
    return draft.to(dtype), target.to(dtype), tokens, vh.to(dtype), valid, ids


@pytest.mark.parametrize("rule, schedule", [("greedy", "vat"), ("sample", "vat"), ("greedy", "dflash"),
                                            ("sample", "hard_cutoff"), ("greedy", "vat_soft")])
def test_draft_vocab_matches_reference(backend, rule, schedule):
    """Over a draft vocabulary (V' = 40 of 300 ids): values, acceptance and gradients equal the
    reference written from the definition; labels outside V' add no hard term; a target argmax
    outside V' rejects under the greedy rule."""
    draft, target, tokens, vh, valid, ids = _draft_vocab_inputs(6, 5, 300, 40, seed=11)
    (ours, g_ours, gh_ours), (ref, g_ref, gh_ref) = run_both(
        backend, (draft, target, tokens, vh, valid), rule=rule, schedule=schedule, temperature=0.8, seed=5,
        draft_vocab=ids)
    assert torch.equal(ours.first_reject.cpu(), ref.first_reject)
    assert torch.equal(ours.accept.cpu(), ref.accept)
    for name in ("loss", "ce_loss", "vh_loss"):
        torch.testing.assert_close(getattr(ours, name).cpu(), getattr(ref, name), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(g_ours.cpu(), g_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gh_ours.cpu(), gh_ref, rtol=1e-9, atol=1e-12)
    assert 0 < float(ref.accept[valid].mean()) < 1
    if rule == "greedy":   # rejected wherever the target's argmax is not a draft token
        top_in = (target.argmax(-1)[..., None] == ids).any(-1)
        assert bool((ref.accept[valid & ~top_in] == 0).all()) and bool((~top_in & valid).any())
    # the reduced loss is not the one-vocabulary loss of the gathered logits
    plain = reference.vat_loss(draft, target[..., ids], torch.zeros_like(tokens), vh, valid, rule=rule,
                               schedule=schedule, temperature=0.8, generator=torch.Generator().manual_seed(5))
    assert not torch.allclose(plain.loss, ref.loss)


def test_draft_vocab_hand_built():
    """One block of 3 positions, V = 6, V' = {4, 1}: position 1 accepted (argmax 4 drafted), position 2
    rejected (the target's argmax 5 is not a draft token), its label 5 adds no hard term."""
    ids = torch.tensor([4, 1])
    target = torch.full((1, 3, 6), -5.0, dtype=torch.float64)
    target[0, 0, 4], target[0, 1, 5], target[0, 1, 1], target[0, 2, 1] = 3.0, 4.0, 2.0, 3.0
    draft = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [0.0, 2.0]]], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([[4, 5, 1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    out = vat.vat_loss(draft, target, tokens, None, valid, schedule="prefix_only", draft_vocab=ids)
    assert out.accept.tolist() == [[1.0, 0.0, 1.0]] and out.first_reject.tolist() == [2]
    log_q = torch.log_softmax(draft.detach()[0, 0], -1)
    p = torch.softmax(target[0, 0, ids], -1)
    expected = -(p * log_q).sum() - log_q[0]                       # position 1 only (prefix_only)
    torch.testing.assert_close(out.ce_loss, expected)
    out.loss.backward()
    assert float(draft.grad[0, 1:].abs().max()) == 0.0


def test_draft_vocab_sample_rule_accepts_against_the_whole_vocabulary():
    """The sampling rule over V' accepts at the rate sum over V' of min(p, q), p normalized over
    all of V (not the higher rate the renormalized p would give)."""
    gen = torch.Generator().manual_seed(2)
    vocab, ids = 12, torch.tensor([0, 3, 5, 7])
    target = torch.randn(1, 1, vocab, generator=gen, dtype=torch.float64).expand(20000, 1, vocab).contiguous()
    draft = torch.randn(1, 1, 4, generator=gen, dtype=torch.float64).expand(20000, 1, 4).contiguous()
    out = vat.vat_loss(draft, target, torch.zeros(20000, 1, dtype=torch.int64), None,
                       torch.ones(20000, 1, dtype=torch.bool), rule="sample",
                       generator=torch.Generator().manual_seed(0), draft_vocab=ids)
    p, q = torch.softmax(target[0, 0], -1)[ids], torch.softmax(draft[0, 0], -1)
    exact = float(torch.minimum(p, q).sum())
    renormalized = float(torch.minimum(p / p.sum(), q).sum())
    rate = float(out.accept.mean())
    assert abs(rate - exact) < 0.015 and renormalized - exact > 0.1


def test_draft_vocab_linear_equals_materialized(backend):
    h_d, _, h_t, w_t, tokens, vh, valid = backend.put(*_linear_inputs(5, 4, 150, 12, 10, torch.float64, seed=6))
    ids, w_d = backend.put(torch.randperm(150, generator=torch.Generator().manual_seed(1))[:30],
                           torch.randn(30, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    tokens = torch.where(torch.arange(tokens.numel(), device=tokens.device).view_as(tokens) % 2 == 0,
                         ids[tokens % 30], tokens)             # half the labels in V'
    for rule, schedule in (("greedy", "vat"), ("sample", "vat"), ("greedy", "vat_soft")):
        leaves = [t.clone().requires_grad_(True) for t in (h_d, w_d, vh)]
        out = api(backend).vat_loss_linear(leaves[0], leaves[1], h_t, w_t, tokens, leaves[2], valid, rule=rule,
                                           generator=torch.Generator().manual_seed(3), chunk_size=4, draft_vocab=ids,
                                           schedule=schedule)
        out.loss.backward()
        mats = [t.clone().requires_grad_(True) for t in (h_d, w_d, vh)]
        expected = api(backend).vat_loss(mats[0] @ mats[1].t(), h_t @ w_t.t(), tokens, mats[2], valid, rule=rule,
                                         generator=torch.Generator().manual_seed(3), draft_vocab=ids,
                                         schedule=schedule)
        expected.loss.backward()
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-10, atol=1e-12)
        assert torch.equal(out.accept, expected.accept)
        for ours, ref in zip(leaves, mats):
            torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("vocab_ids", [False, True])
def test_accept_width_matches_reference(backend, vocab_ids):
    """Tree acceptance (``accept_width`` W > 1): values, acceptance and gradients equal the reference;
    acceptance is monotone in W, W = 1 is the chain's rule and W = V' accepts every position whose
    target argmax is a draft token."""
    if vocab_ids:
        draft, target, tokens, vh, valid, ids = _draft_vocab_inputs(6, 5, 300, 40, seed=4)
        target[1:4, :, ids[5]] += 20.0              # argmaxes in V' that a random draft ranks anywhere
        draft[1:4] = 3.0 * torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(9), dtype=draft.dtype)
        options = dict(draft_vocab=ids)
    else:
        draft, target, tokens, vh, valid = make_inputs(6, 5, 40, dtype=torch.float64, seed=4, noise=3.0)
        ids, options = torch.arange(40), {}
    previous = None
    for width in (1, 3, 40):
        (ours, g_ours, gh_ours), (ref, g_ref, gh_ref) = run_both(
            backend, (draft, target, tokens, vh, valid), schedule="vat", decay_gamma=2.0, accept_width=width,
            **options)
        assert torch.equal(ours.accept.cpu(), ref.accept) and torch.equal(ours.first_reject.cpu(), ref.first_reject)
        torch.testing.assert_close(ours.loss.cpu(), ref.loss, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(g_ours.cpu(), g_ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gh_ours.cpu(), gh_ref, rtol=1e-9, atol=1e-12)
        if width == 1:
            plain = api(backend).vat_loss(draft.to(backend.device), target.to(backend.device),
                                          tokens.to(backend.device), None, valid.to(backend.device), schedule="vat",
                                          decay_gamma=2.0, **{k: v.to(backend.device) for k, v in options.items()})
            assert torch.equal(plain.accept.cpu(), ref.accept)
        else:
            assert bool((ref.accept >= previous).all()) and bool((ref.accept > previous).any())
        previous = ref.accept
    top_in = (target.argmax(-1, keepdim=True) == ids).any(-1) & valid
    assert torch.equal(previous, top_in.float())   # W = V': every draft token is drafted
    assert 0 < float(previous[valid].mean()) <= 1 and (not vocab_ids or bool((~top_in & valid).any()))


def test_accept_width_hand_built():
    """One block, V = 5: the target's argmax is the drafter's 2nd choice at position 1 and its 3rd at
    position 2: W = 1 rejects at 1, W = 2 at 2, W = 3 accepts both."""
    draft = torch.tensor([[[3.0, 2.0, 0.0, 0.0, 0.0], [0.0, 3.0, 2.0, 1.0, 0.0]]])
    target = torch.zeros(1, 2, 5)
    target[0, 0, 1], target[0, 1, 3] = 5.0, 5.0
    tokens, valid = torch.tensor([[1, 3]]), torch.ones(1, 2, dtype=torch.bool)
    for width, accept, first in ((1, [0.0, 0.0], 1), (2, [1.0, 0.0], 2), (3, [1.0, 1.0], 3)):
        out = vat.vat_loss(draft, target, tokens, None, valid, accept_width=width)
        assert out.accept.tolist() == [accept] and out.first_reject.tolist() == [first], width


def test_accept_width_bad_input():
    draft, target, tokens, vh, valid = make_inputs(2, 3, 10)
    for bad in (0, 11, 2.0, True):
        with pytest.raises(ValueError, match="accept_width"):
            vat.vat_loss(draft, target, tokens, vh, valid, accept_width=bad)
    with pytest.raises(ValueError, match="rule='greedy'"):
        vat.vat_loss(draft, target, tokens, vh, valid, accept_width=2, rule="sample")


def test_draft_vocab_bad_input():
    draft, target, tokens, vh, valid, ids = _draft_vocab_inputs(2, 3, 50, 10, seed=1)
    for bad, match in ((ids[:9], "columns"), (ids.clone().fill_(3), "distinct"), (ids + 100, r"\[0, 50\)"),
                       (ids.int(), "int64")):
        with pytest.raises(ValueError, match=match):
            vat.vat_loss(draft, target, tokens, vh, valid, draft_vocab=bad)
    with pytest.raises(ValueError, match="vocabulary size"):
        vat.vat_loss(draft, target, tokens, vh, valid)          # V' logits without the map


def test_linear_gradients_only_where_needed(backend):
    h_d, w_d, h_t, w_t, tokens, vh, valid = backend.put(*_linear_inputs(3, 4, 60, 8, 8, torch.float64, seed=8))
    full = api(backend).vat_loss_linear(h_d, w_d, h_t, w_t, tokens, vh, valid, chunk_size=4)
    with torch.no_grad():
        no_grad = api(backend).vat_loss_linear(h_d, w_d, h_t, w_t, tokens, vh, valid, chunk_size=4)
    assert torch.equal(full.loss, no_grad.loss)
    w_only = w_d.clone().requires_grad_(True)
    out = api(backend).vat_loss_linear(h_d, w_only, h_t, w_t, tokens, vh, valid, chunk_size=4)
    out.loss.backward()
    leaves = [h_d.clone().requires_grad_(True), w_d.clone().requires_grad_(True)]
    api(backend).vat_loss_linear(leaves[0], leaves[1], h_t, w_t, tokens, vh, valid, chunk_size=4).loss.backward()
    assert torch.equal(w_only.grad, leaves[1].grad) and leaves[0].grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_low_precision(backend, dtype):
    h_d, w_d, h_t, w_t, tokens, vh, valid = backend.put(*_linear_inputs(4, 4, 200, 16, 8, dtype, seed=6))
    leaves = [t.clone().requires_grad_(True) for t in (h_d, w_d)]
    out = api(backend).vat_loss_linear(leaves[0], leaves[1], h_t, w_t, tokens, None, valid, chunk_size=8)
    out.loss.backward()
    mats = [t.detach().double().requires_grad_(True) for t in (h_d, w_d)]
    ref = reference.vat_loss((mats[0] @ mats[1].t()).cpu(), (h_t.double() @ w_t.double().t()).cpu(), tokens.cpu(),
                             None, valid.cpu())
    ref.loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.loss.double().cpu(), ref.loss, rtol=tol, atol=tol)
    assert leaves[0].grad.dtype == dtype and leaves[1].grad.dtype == dtype
    for ours, expected in zip(leaves, mats):
        scale = float(expected.grad.abs().max())  # 16-bit gradients: errors relative to the largest entry
        torch.testing.assert_close(ours.grad.double().cpu(), expected.grad.cpu(), rtol=tol,
                                   atol=scale * (1e-5 if dtype == torch.float32 else 1.5e-2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_rounds_like_torch(backend, dtype):
    """The row gradient's float -> 16-bit conversion: with g_q = g_p = 0 the kernel writes -g_y at the
    token, so special values (subnormals, ties, overflow, NaN) go through it exactly."""
    values = torch.tensor([1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 65504.0, 65519.0, 65520.0, 1e6,
                           6.1e-5, 2 ** -24, 2 ** -25, 1.5 * 2 ** -25, 3 * 2 ** -25, 1e-8, 2 ** -14 - 2 ** -25,
                           1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.4e38, float("inf"), 1e-40, 0.1, 1 / 3],
                          dtype=torch.float32)
    values = torch.cat([values, -values, torch.randn(200) * 10 ** torch.randint(-9, 5, (200,)).float()])
    rows = values.shape[0]
    logits = torch.zeros(rows, 3, dtype=dtype)
    tokens = torch.ones(rows, dtype=torch.int64)
    zeros = torch.zeros(rows)
    lse = torch.zeros(rows)
    kernels = backend.ops if backend.name == "emu" else None
    args = backend.put(zeros, zeros, -values, logits, logits, tokens, lse, lse)
    if kernels is not None:
        grad = kernels.vat_row_backward(*args)
    else:
        grad = torch.ops.dartree_ext.vat_row_backward(*args)
    assert torch.equal(grad.cpu()[:, 1].view(torch.int16), values.to(dtype).view(torch.int16))
    assert float(grad.cpu()[:, [0, 2]].abs().max()) == 0.0


def test_all_invalid_rows_skip_reads(backend):
    """Rows with zero gradient coefficients get exact zeros even when their logits are NaN."""
    draft = torch.full((2, 40), float("nan"))
    lse = torch.zeros(2)
    args = backend.put(lse, lse, lse, draft, draft, torch.zeros(2, dtype=torch.int64), lse, lse)
    kernels = backend.ops.vat_row_backward if backend.name == "emu" else torch.ops.dartree_ext.vat_row_backward
    assert torch.equal(kernels(*args).cpu(), torch.zeros(2, 40))


# --- opcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", [False, True])
def test_opcheck_row_forward(device, sample):
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(6, 33, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
    target = torch.randn(6, 33, generator=gen, dtype=torch.float64).to(device)
    tokens = torch.randint(0, 33, (6,), generator=gen).to(device)
    uniforms = torch.rand(6, 2, generator=gen).to(device) if sample else None
    torch.library.opcheck(torch.ops.dartree_ext.vat_row_forward.default, (draft, target, tokens, uniforms, 0.8))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_row_backward_and_block_weights(device):
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(6, 33, generator=gen).to(device)
    target = torch.randn(6, 33, generator=gen).to(device)
    tokens = torch.randint(0, 33, (6,), generator=gen).to(device)
    g = [torch.rand(6, generator=gen).to(device) for _ in range(3)]
    lse_d, lse_t = torch.logsumexp(draft, -1), torch.logsumexp(target, -1)
    torch.library.opcheck(torch.ops.dartree_ext.vat_row_backward.default, (*g, draft, target, tokens, lse_d, lse_t))
    accept = (torch.rand(4, 5, generator=gen) < 0.7).float().to(device)
    valid = (torch.rand(4, 5, generator=gen) < 0.8).to(device)
    for schedule in range(5):
        torch.library.opcheck(torch.ops.dartree_ext.vat_block_weights.default, (accept, valid, schedule, 3.0))


def test_vat_loss_compiles():
    draft, target, tokens, vh, valid = make_inputs(2, 3, 20, seed=1)
    draft[1, 0] = 0.0

    def loss(d, h):
        return vat.vat_loss(d, target, tokens, h, valid, check_finite=False).loss

    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(draft, vh), loss(draft, vh))


# --- bad input ----------------------------------------------------------------------------------


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def _good(device, m=2, k=3, vocab=10):
    draft, target, tokens, vh, valid = make_inputs(m, k, vocab, seed=0)
    return [t.to(device) for t in (draft, target, tokens, vh, valid)]


def test_bad_vocab_and_shapes(device):
    draft, target, tokens, vh, valid = _good(device)
    with pytest.raises(ValueError, match="target_logits has vocabulary size 9 but draft_logits has 10"):
        vat.vat_loss(draft, target[..., :9], tokens, vh, valid)
    with pytest.raises(ValueError, match=r"target_logits must have draft_logits' shape \(2, 3, 10\)"):
        vat.vat_loss(draft, target[:1], tokens, vh, valid)
    with pytest.raises(ValueError, match=r"draft_logits must be \[M, K, V\]"):
        vat.vat_loss(draft[0], target[0], tokens, vh, valid)
    with pytest.raises(ValueError, match=r"target_tokens must have shape \[M, K\] = \[2, 3\]"):
        vat.vat_loss(draft, target, tokens[:, :2], vh, valid)
    with pytest.raises(ValueError, match=r"valid must have shape \[M, K\]"):
        vat.vat_loss(draft, target, tokens, vh, valid[:1])
    with pytest.raises(ValueError, match=r"vh_logits must have shape \[M, K\]"):
        vat.vat_loss(draft, target, tokens, vh[:, :1], valid)


def test_bad_dtypes(device):
    draft, target, tokens, vh, valid = _good(device)
    with pytest.raises(TypeError, match="target_tokens must be an int64 tensor, got torch.int32"):
        vat.vat_loss(draft, target, tokens.int(), vh, valid)
    with pytest.raises(TypeError, match="valid must be a bool tensor, got torch.float32"):
        vat.vat_loss(draft, target, tokens, vh, valid.float())
    with pytest.raises(TypeError, match="draft_logits must be float32, bfloat16, float16 or float64, got torch.int64"):
        vat.vat_loss(tokens[..., None].expand(2, 3, 10), target, tokens, vh, valid)
    with pytest.raises(TypeError, match="target_logits must have draft_logits' dtype torch.float32"):
        vat.vat_loss(draft, target.double(), tokens, vh, valid)
    with pytest.raises(TypeError, match="vh_logits must be a floating-point tensor"):
        vat.vat_loss(draft, target, tokens, tokens, valid)


def test_bad_options(device):
    draft, target, tokens, vh, valid = _good(device)
    for t in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be finite and > 0, got"):
            vat.vat_loss(draft, target, tokens, vh, valid, rule="sample", temperature=t)
    for t in (0.0, -1.0, float("nan")):  # the greedy rule does not use it, but a wrong value is still an error
        with pytest.raises(ValueError, match="temperature"):
            vat.vat_loss(draft, target, tokens, vh, valid, rule="greedy", temperature=t)
    with pytest.raises(ValueError, match="rule must be one of"):
        vat.vat_loss(draft, target, tokens, vh, valid, rule="topk")
    with pytest.raises(ValueError, match="schedule must be one of"):
        vat.vat_loss(draft, target, tokens, vh, valid, schedule="linear")
    with pytest.raises(ValueError, match="decay_gamma must be finite and > 0"):
        vat.vat_loss(draft, target, tokens, vh, valid, decay_gamma=0.0)


def test_all_invalid_is_an_error(device):
    draft, target, tokens, vh, valid = _good(device)
    with pytest.raises(ValueError, match="valid has no True entry"):
        vat.vat_loss(draft, target, tokens, vh, torch.zeros_like(valid))
    with pytest.raises(ValueError, match="valid has no True entry"):
        vat.vat_loss_linear(draft, torch.eye(10, device=device), target, torch.eye(10, device=device), tokens, vh,
                            torch.zeros_like(valid))


def test_non_finite_inputs_are_named(device):
    draft, target, tokens, vh, valid = _good(device)
    bad = draft.clone()
    bad[1, 2, 4] = float("nan")
    with pytest.raises(FloatingPointError, match=r"draft_logits has NaN or inf values at valid position \[1, 2\]"):
        vat.vat_loss(bad, target, tokens, vh, valid)
    bad = target.clone()
    bad[0, 1, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"target_logits has NaN or inf values at valid position \[0, 1\]"):
        vat.vat_loss(draft, bad, tokens, vh, valid)
    bad = tokens.clone()
    bad[1, 0] = 10
    with pytest.raises(FloatingPointError, match=r"target_tokens\[1, 0\] = 10 is outside the vocabulary \[0, 10\)"):
        vat.vat_loss(draft, target, bad, vh, valid)
    # at an invalid position the same values are ignored
    bad = draft.clone()
    bad[0, 2] = float("nan")  # valid[0, 2] is False
    assert torch.isfinite(vat.vat_loss(bad, target, tokens, vh, valid).loss)
    # without the check nothing synchronizes and the NaN comes back
    bad[1, 2, 4] = float("nan")
    assert torch.isnan(vat.vat_loss(bad, target, tokens, vh, valid, check_finite=False).loss)


def test_linear_bad_input(device):
    h = torch.randn(2, 3, 4, device=device)
    w = torch.randn(10, 4, device=device)
    tokens = torch.zeros(2, 3, dtype=torch.int64, device=device)
    valid = torch.ones(2, 3, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="target_weight has vocabulary size 9 but draft_weight has 10"):
        vat.vat_loss_linear(h, w, h, w[:9], tokens, None, valid)
    with pytest.raises(ValueError, match=r"draft_weight must be \[V, Hd\] with Hd = 4"):
        vat.vat_loss_linear(h, w[:, :3], h, w, tokens, None, valid)
    with pytest.raises(TypeError, match="target_hidden must have draft_hidden's dtype"):
        vat.vat_loss_linear(h, w, h.double(), w, tokens, None, valid)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        vat.vat_loss_linear(h, w, h, w, tokens, None, valid, chunk_size=0)
    bad = h.clone()
    bad[1, 1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"draft_hidden \(or draft_weight\) has NaN or inf values at valid "
                                                 r"position \[1, 1\]"):
        vat.vat_loss_linear(bad, w, h, w, tokens, None, valid)


def test_op_level_checks_name_arguments(device):
    draft = torch.randn(4, 10, device=device)
    tokens = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="vat_row_forward: target_logits must have the draft's vocabulary size 10"):
        torch.ops.dartree_ext.vat_row_forward(draft, draft[:, :9].contiguous(), tokens, None, 1.0)
    with pytest.raises(RuntimeError, match="vat_row_forward: target_tokens must be Long"):
        torch.ops.dartree_ext.vat_row_forward(draft, draft, tokens.int(), None, 1.0)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        torch.ops.dartree_ext.vat_row_forward(draft, draft, tokens, torch.rand(4, 2, device=device), 0.0)
    with pytest.raises(RuntimeError, match="vat_block_weights: valid must be Bool"):
        torch.ops.dartree_ext.vat_block_weights(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device), 0, 7.0)
    with pytest.raises(ValueError, match="vat_block_weights: schedule must be 0..4"):
        torch.ops.dartree_ext.vat_block_weights(torch.ones(2, 2, device=device),
                                                torch.ones(2, 2, dtype=torch.bool, device=device), 5, 7.0)


def test_exported():
    assert dartree_ext.vat_loss is vat.vat_loss and dartree_ext.vat_loss_linear is vat.vat_loss_linear
    assert dartree_ext.VATLossOutput._fields == ("loss", "ce_loss", "vh_loss", "first_reject", "accept", "weights")
