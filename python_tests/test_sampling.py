"""target_tokens_from_logits: argmax at T = 0; at T > 0 samples whose distribution matches the
warped softmax (checked by counts over many draws, with a stated tolerance, not by one seed)."""
from __future__ import annotations

import math

import pytest

import torch

from dartree_ext import target_tokens_from_logits

DRAWS = 40_000


def _frequencies(logits: torch.Tensor, **kwargs) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    rows = logits.expand(DRAWS, -1)
    tokens = target_tokens_from_logits(rows, generator=gen, **kwargs)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / DRAWS


def _assert_close_in_distribution(freq: torch.Tensor, probs: torch.Tensor) -> None:
    # each count is binomial: allow 5 standard deviations (a false alarm about once in 10^6 runs)
    for f, p in zip(freq.tolist(), probs.tolist()):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / DRAWS)
        assert abs(f - p) <= 5 * sigma + 1e-9, (freq, probs)


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    assert target_tokens_from_logits(logits).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_ties_at_vocabulary_size(dtype):
    """Rows of a 49152-token vocabulary with few distinct values, so every row's maximum is tied at
    many ids spread over the row: the lowest id wins, as torch.argmax gives it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (3, 23, 49152), generator=gen).to(dtype)
    logits[0, 0] = 0.0
    logits[0, 1, -1] = 5.0
    logits[0, 2, 30000:] = 7.0
    expected = logits.float().argmax(-1)
    assert expected[0, :3].tolist() == [0, 49151, 30000]
    assert torch.equal(target_tokens_from_logits(logits), expected)


@pytest.mark.parametrize("shape", [(3, 23, 49152), (5, 4096), (2, 3, 1000), (7, 64), (4, 256), (0, 512)])
def test_blocked_argmax_equals_first_maximum(shape):
    """The blocked argmax (row cut into blocks, first block holding the maximum, then inside it)
    gives torch's first-maximum index: random rows, heavy ties across blocks, all -inf, a NaN."""
    from dartree_ext.sampling import _first_argmax
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    cases = [torch.randn(shape, generator=gen), torch.randint(0, 3, shape, generator=gen).float(),
             torch.full(shape, float("-inf"))]
    if shape[0]:
        nan = torch.randn(shape, generator=gen)
        nan[0, ..., shape[-1] // 2] = float("nan")
        cases.append(nan)
    for logits in cases:
        assert torch.equal(_first_argmax(logits), logits.max(-1).indices)
        assert torch.equal(_first_argmax(logits), logits.argmax(-1)) or logits.isnan().any()


def test_shape_follows_logits():
    logits = torch.randn(2, 7, 11)
    assert target_tokens_from_logits(logits).shape == (2, 7)
    assert target_tokens_from_logits(logits, temperature=0.7).shape == (2, 7)


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]])
    for temperature in (0.5, 1.0, 2.0):
        probs = (logits / temperature).softmax(-1)[0].double()
        _assert_close_in_distribution(_frequencies(logits, temperature=temperature), probs)


def test_top_k_keeps_the_k_best_renormalized():
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]])
    freq = _frequencies(logits, temperature=1.0, top_k=2)
    probs = torch.zeros(5, dtype=torch.float64)
    probs[[0, 3]] = logits[0, [0, 3]].double().softmax(-1)
    _assert_close_in_distribution(freq, probs)


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().float()[None]
    freq = _frequencies(logits, temperature=1.0, top_p=0.75)  # 0.5 + 0.3 reaches 0.75: keep two
    _assert_close_in_distribution(freq, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))


def test_generator_makes_it_reproducible():
    logits = torch.randn(64, 50)
    a = target_tokens_from_logits(logits, 1.0, generator=torch.Generator().manual_seed(5))
    b = target_tokens_from_logits(logits, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_never_samples_a_token_of_zero_probability():
    """Filtered tokens (-inf logits) at the start, in the middle and at the end of the vocabulary,
    and a vocabulary where nearly all mass sits on the last token: the sampler's cumulative
    search never lands on a zero-probability token and stays in range."""
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), float("-inf"), 1.0, float("-inf")]])
    freq = _frequencies(logits, temperature=1.0)
    assert freq[[0, 2, 3, 5]].sum() == 0
    _assert_close_in_distribution(freq, logits[0].double().softmax(-1))
    peaked = torch.full((1, 5000), -30.0)
    peaked[0, -1] = 30.0
    tokens = target_tokens_from_logits(peaked.expand(1000, -1), 1.0, generator=torch.Generator().manual_seed(2))
    assert (tokens == 4999).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_leaves_the_logits_untouched(temperature):
    """The sampler works in place on its own copy: a float32 caller's logits (which .float()
    would hand back as they are) and an expanded view stay as they were."""
    logits = torch.randn(3, 5, 97)
    before = logits.clone()
    target_tokens_from_logits(logits, temperature, top_k=20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)
    row = torch.randn(1, 1, 97)
    tokens = target_tokens_from_logits(row.expand(2, 4, 97), temperature, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (2, 4) and torch.equal(row, row.clone())


# tokens_from_logits: the one-call CPU path target_tokens_from_logits takes ----------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_greedy_is_the_first_maximum(dtype):
    """Greedy tokens from the one-call op equal torch.argmax: random rows over 49152 and odd
    sizes, ties to the lowest id (also across its 64-wide blocks), a +inf maximum in the last,
    partial block; a row holding a NaN, or all -inf, is refused and named."""
    from dartree_ext import ops
    gen = torch.Generator().manual_seed(0)
    for shape in ((7, 49152), (3, 4, 130), (1, 1)):
        logits = torch.randn(shape, generator=gen).to(dtype)
        assert torch.equal(ops.tokens_from_logits(logits, None, 0.0), logits.float().argmax(-1))
    ties = torch.zeros(2, 300, dtype=dtype)
    ties[0, [5, 70, 299]] = 3.0
    ties[1, [299]] = 1.0
    assert ops.tokens_from_logits(ties, None, 0.0).tolist() == [5, 299]
    edge = torch.full((2, 130), -1.0, dtype=dtype)
    edge[0, 129] = float("inf")                                             # the maximum in the last, partial block
    edge[1, :64] = float("-inf")
    assert ops.tokens_from_logits(edge, None, 0.0).tolist() == edge.float().argmax(-1).tolist() == [129, 64]
    for temperature, u in ((0.0, None), (1.0, torch.full((3, 1), 0.5))):
        nan = torch.randn(3, 200).to(dtype)
        nan[1, 150] = float("nan")
        with pytest.raises(ValueError, match=r"tokens_from_logits: logits row 1 of 3 holds a NaN"):
            ops.tokens_from_logits(nan, u, temperature)
        dead = torch.randn(3, 200).to(dtype)
        dead[2] = float("-inf")
        with pytest.raises(ValueError, match=r"logits row 2 of 3 is all -inf"):
            ops.tokens_from_logits(dead, u, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_one_call_sampling_matches_softmax(dtype, temperature):
    """Sampled tokens from the one-call op follow softmax(logits / T) over a vocabulary that
    spans several 64-token blocks, with tokens of zero probability (-inf) never drawn; a uniform
    next to 1 lands on the last token of positive probability."""
    from dartree_ext import ops
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 200, generator=gen) * 2).to(dtype)
    logits[0, torch.arange(0, 200, 7)] = float("-inf")
    n = DRAWS
    u = torch.rand(n, 1, generator=gen)
    tokens = ops.tokens_from_logits(logits.expand(n, -1), u, temperature)
    freq = torch.bincount(tokens, minlength=200).double() / n
    probs = (logits.float() / temperature).softmax(-1)[0].double()
    assert freq[probs == 0].sum() == 0
    _assert_close_in_distribution(freq, probs)
    from dartree_ext import reference
    want = reference.tokens_from_logits(logits.expand(n, -1), u, temperature)
    assert (want == tokens).float().mean() > 0.999  # (rounding apart: blocked sums, polynomial exp)
    last = int(torch.nonzero(probs > 0).max())
    assert ops.tokens_from_logits(logits, torch.tensor([[1.0 - 2 ** -24]]), temperature).item() == last
    assert ops.tokens_from_logits(logits, torch.tensor([[0.0]]), temperature).item() == int(torch.nonzero(probs > 0).min())


def test_one_call_bad_input():
    from dartree_ext import ops
    with pytest.raises(RuntimeError, match="needs uniforms"):
        ops.tokens_from_logits(torch.randn(2, 5), None, 1.0)
    with pytest.raises(RuntimeError, match="one value per row"):
        ops.tokens_from_logits(torch.randn(2, 5), torch.rand(3), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.tokens_from_logits(torch.randn(2, 5).half(), None, 0.0)
    for bad in (float("nan"), -0.1, 1.0):
        with pytest.raises(ValueError, match=r"uniforms\[1\] = .* is outside \[0, 1\)"):
            ops.tokens_from_logits(torch.randn(2, 5), torch.tensor([0.5, bad]), 1.0)


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (1.0, 3), (0.7, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_tokens_refuse_undrawable_rows(temperature, top_k, dtype):
    """Every path of target_tokens_from_logits (the one-call op, the float64 / top-k path) refuses
    a row holding a NaN or all -inf, naming it, and an empty vocabulary."""
    for fill in (float("nan"), float("-inf")):
        logits = torch.randn(2, 3, 70, dtype=dtype)
        logits[1, 2] = fill
        with pytest.raises(ValueError, match=r"logits row 5 of 6 (holds a NaN|is all -inf)"):
            target_tokens_from_logits(logits, temperature, top_k=top_k, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"V >= 1"):
        target_tokens_from_logits(torch.zeros(2, 0, dtype=dtype), temperature)


def test_one_call_degenerate_rows_and_default_dtype():
    """A +inf logit takes every draw, a temperature whose inverse overflows is greedy, and the
    sampler works whatever torch's default dtype (its uniforms are drawn in it)."""
    from dartree_ext import ops
    logits = torch.randn(2, 300)
    logits[0, 123] = float("inf")
    u = torch.rand(2, 1)
    assert ops.tokens_from_logits(logits, u, 1.0)[0].item() == 123
    assert torch.equal(ops.tokens_from_logits(logits, u, 1e-39), logits.argmax(-1))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        tokens = target_tokens_from_logits(torch.randn(3, 50), 1.0, generator=torch.Generator().manual_seed(0))
    finally:
        torch.set_default_dtype(old)
    assert tokens.shape == (3,)


# speculative sampling of one drafted child per node ------------------------------------------------

@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (0.7, 0.8)])
def test_speculative_tokens_are_distributed_as_the_target(temperature, top_p):
    """Children drawn from q (with a token q never proposes, and one q proposes that p excludes under
    top-p): the result is distributed as the warped target p, the child is accepted with
    probability 1 - TV(p, q), and a node without a child gets a plain sample of p."""
    from dartree_ext.sampling import speculative_tokens, warped_probs
    gen = torch.Generator().manual_seed(7)
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, -2.0, 0.0]])
    q = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1, 0.0])
    p = warped_probs(logits, temperature, None, top_p)[0]
    child = torch.multinomial(q, DRAWS, replacement=True, generator=gen)
    child[: DRAWS // 10] = -1  # a tenth of the nodes have no drafted child
    out = speculative_tokens(logits.expand(DRAWS, -1)[None], child[None], q.expand(DRAWS, -1)[None], temperature,
                             top_p=top_p, generator=gen)[0]
    _assert_close_in_distribution(torch.bincount(out, minlength=6).double() / DRAWS, p)
    has = child >= 0
    accepted = float((out[has] == child[has]).double().mean())
    one_minus_tv = float(torch.minimum(p, q).sum())
    sigma = math.sqrt(one_minus_tv * (1 - one_minus_tv) / int(has.sum()))
    # (a rejected child has p < q there, so the residual never draws it: equal means accepted)
    assert abs(accepted - one_minus_tv) <= 5 * sigma


def test_speculative_tokens_reject_a_wrong_draft_distribution_in_the_test():
    """The check above can fail: claiming the children came from the uniform distribution when
    they came from q biases the result away from p."""
    from dartree_ext.sampling import speculative_tokens, warped_probs
    gen = torch.Generator().manual_seed(8)
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, -2.0, 0.0]])
    q = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1, 0.0])
    child = torch.multinomial(q, DRAWS, replacement=True, generator=gen)
    out = speculative_tokens(logits.expand(DRAWS, -1)[None], child[None], torch.full((1, DRAWS, 6), 1 / 6), 1.0,
                             generator=gen)[0]
    freq, p = torch.bincount(out, minlength=6).double() / DRAWS, warped_probs(logits, 1.0)[0]
    with pytest.raises(AssertionError):
        _assert_close_in_distribution(freq, p)


def test_speculative_tokens_bad_input():
    from dartree_ext.sampling import speculative_tokens
    with pytest.raises(ValueError, match="do not match"):
        speculative_tokens(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, 4), 1.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        speculative_tokens(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, 5), 0.0)
