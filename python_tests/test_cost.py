"""Per-round tree sizing: the cost model (validation, interpolation, the on-disk cache and its
key), the size chooser on synthetic curves with known optima, the acceptance calibrator, the
dtype choice, and ``budget="auto"`` staying lossless (T = 0 equal to greedy generate for every
method it supports, batch > 1, both when trees pay and when plain decoding wins)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext.decoding import SpeculativeDecoder  # noqa: E402
from dartree_ext.decoding import calibration  # noqa: E402
from dartree_ext.decoding import profiling  # noqa: E402
from dartree_ext.decoding.calibration import AcceptanceCalibrator, AcceptanceLevel, DepthCalibrator  # noqa: E402
from dartree_ext.decoding.cost import CostModel, choose_size  # noqa: E402
from dartree_ext.decoding.methods import AUTO_METHODS, EAGLE3_METHODS  # noqa: E402
from dartree_ext.decoding.sizing import PROBE_DEPTH  # noqa: E402
from dartree_ext.models import LookupDrafter  # noqa: E402
from models import tiny_drafter, tiny_target  # noqa: E402
from test_decoding import NEW, check_greedy, setup  # noqa: E402,F401  (setup: the fixture)



# the cost model ---------------------------------------------------------------------------------
def test_curve_must_not_decrease():
    with pytest.raises(ValueError, match="must not decrease"):
        CostModel.from_curve({0: 10.0, 4: 12.0, 8: 11.0})


@pytest.mark.parametrize("curve,match", [({1: 10.0, 4: 12.0}, "start at 0"), ({0: 0.0, 4: 1.0}, "> 0"),
                                         ({0: float("nan"), 4: 1.0}, "finite"), ({}, "start at 0")])
def test_bad_curves(curve, match):
    with pytest.raises(ValueError, match=match):
        CostModel.from_curve(curve)


def test_bad_contexts_and_times():
    with pytest.raises(ValueError, match="one verify curve per context"):
        CostModel(nodes=[0, 1], contexts=[0, 100], verify_ms=[[1.0, 2.0]])
    with pytest.raises(ValueError, match="strictly increasing"):
        CostModel(nodes=[0, 1], contexts=[100, 100], verify_ms=[[1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match=">= 0"):
        CostModel.from_curve({0: 1.0, 2: 2.0}, draft_ms=-1.0)


def test_interpolation_in_nodes_and_context():
    cost = CostModel(nodes=[0, 4, 8], contexts=[100, 300], verify_ms=[[10.0, 14.0, 22.0], [20.0, 24.0, 32.0]],
                     draft_ms=3.0, tree_ms={"dartree": 1.0})
    assert cost.verify(2, 100) == pytest.approx(12.0)
    assert cost.verify(6, 100) == pytest.approx(18.0)
    assert cost.verify(12, 100) == pytest.approx(30.0)        # linear past the last point
    assert cost.verify(4, 200) == pytest.approx(19.0)         # halfway between the contexts
    assert cost.verify(0, 50) == pytest.approx(10.0)          # never below the shortest context's
    assert cost.round_ms("dartree", 0, 100) == pytest.approx(10.0)       # plain step: no draft, no tree
    assert cost.round_ms("dartree", 4, 100) == pytest.approx(14.0 + 3.0 + 1.0)
    assert cost.round_ms("ddtree", 4, 100) == pytest.approx(14.0 + 3.0)  # no tree time measured for it
    assert cost.round_ms("dartree", 1, 100, batch=4) == pytest.approx(cost.verify(7, 100) + 4.0)
    again = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost


# the chooser ------------------------------------------------------------------------------------
def test_verify_upto_matches_verify():
    """The chooser's table of every n equals verify(n) point by point: inside and past the node
    and context grids, below the first context, with one context and with several."""
    import random
    rng = random.Random(0)
    for _ in range(100):
        nodes = [0] + sorted(rng.sample(range(1, 80), rng.randint(1, 6)))
        contexts = sorted(rng.sample(range(0, 3000), rng.randint(1, 4)))
        base = sorted(rng.uniform(1, 50) for _ in nodes)
        scales = [rng.uniform(0.6, 1.5) for _ in contexts]  # a longer context may even measure cheaper
        cost = CostModel(nodes=nodes, contexts=contexts, verify_ms=[[b * f for b in base] for f in scales])
        for context in (-5, contexts[0], rng.uniform(0, 4000), contexts[-1], contexts[-1] + 500):
            n_max = rng.randint(0, 150)
            assert cost.verify_upto(n_max, context) == pytest.approx([cost.verify(n, context) for n in range(n_max + 1)],
                                                                     rel=1e-12)


def test_chooser_step_cost():
    """Verification costs 10 ms up to 8 nodes and 20 past them; each node adds 0.5 expected
    tokens: (1 + 4) / 10 at n = 8 beats (1 + 8) / 20 at n = 16 and every smaller tree."""
    cost = CostModel.from_curve({0: 10.0, 8: 10.0, 9: 20.0, 16: 20.0})
    n, rate = choose_size([0.5 * i for i in range(17)], cost)
    assert (n, rate) == (8, pytest.approx(0.5))


def test_chooser_geometric_acceptance():
    """A chain whose i-th node is accepted with probability 0.5^i and t(n) = 10 + n ms:
    (1 + 0.5 + 0.25) / 12 > (1 + 0.5 + 0.25 + 0.125) / 13 > 1.5 / 11, so n = 2."""
    cost = CostModel.from_curve({0: 10.0, 64: 74.0})
    expected = [sum(0.5 ** i for i in range(1, n + 1)) for n in range(16)]
    assert choose_size(expected, cost)[0] == 2


def test_chooser_falls_back_to_plain_decoding():
    """A drafter pass as dear as a plain step: no tree pays for itself."""
    cost = CostModel.from_curve({0: 10.0, 64: 12.0}, draft_ms=10.0)
    assert choose_size([0.3 * i for i in range(65)], cost)[0] == 64      # 0.3 tokens per node for 1/32 ms
    assert choose_size([min(0.3 * i, 0.5) for i in range(65)], cost) == (0, pytest.approx(0.1))


def test_chooser_with_running_costs():
    """The decoder's running corrections. t(n) = 10 + n ms, 0.9 tokens for the first node and 0.1
    for each after it. Modelled (no draft cost): (1 + 0.9) / 11 beats (1 + 1) / 12, so n = 1. A
    measured drafter pass plus tree of 10 ms: (1 + 0.9) / 21 < 1 / 10, a plain step. The same
    10 ms with every verification twice the curve's (verify_scale 2): (1 + 0.9) / 32 > 1 / 20 and
    > (1 + 1) / 34, a tree again (the fixed cost weighs less next to dearer steps)."""
    cost = CostModel.from_curve({0: 10.0, 64: 74.0})
    expected = [0.0] + [0.9 + 0.1 * (n - 1) for n in range(1, 17)]
    assert choose_size(expected, cost)[0] == 1
    assert choose_size(expected, cost, drafted_ms=10.0) == (0, pytest.approx(0.1))
    assert choose_size(expected, cost, verify_scale=2.0, drafted_ms=10.0) == (1, pytest.approx(1.9 / 32))
    with pytest.raises(ValueError, match="verify_scale"):
        choose_size(expected, cost, verify_scale=0.0)
    with pytest.raises(ValueError, match="drafted_ms"):
        choose_size(expected, cost, drafted_ms=-1.0)


def test_chooser_batch_and_bad_input():
    cost = CostModel.from_curve({0: 10.0, 7: 10.0, 15: 30.0})
    # two rows: n = 3 costs 7 nodes' time (10 ms) and gains 2 * 0.4 * 3 = 2.4 tokens
    assert choose_size([0.8 * i for i in range(8)], cost, batch=2)[0] == 3
    with pytest.raises(ValueError, match=r"expected\[0\] must be 0"):
        choose_size([1.0, 2.0], cost)


def _isotonic_reference(values, weights):
    """The non-decreasing least-squares fit by its min-max formula:
    f(i) = max over k <= i of min over l >= i of the weighted mean of values[k..l]."""
    def mean(k, l):
        return sum(v * w for v, w in zip(values[k:l + 1], weights[k:l + 1])) / sum(weights[k:l + 1])
    n = len(values)
    return [max(min(mean(k, l) for l in range(i, n)) for k in range(i + 1)) for i in range(n)]


def test_isotonic_fit():
    assert calibration.isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert calibration.isotonic([1.0, 3.0, 2.0], [1.0, 1.0, 3.0]) == [1.0, 2.25, 2.25]
    assert calibration.isotonic([3.0, 1.0, 2.0], increasing=False) == [3.0, 1.5, 1.5]
    assert calibration.isotonic([]) == []
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        values = torch.randn(n, generator=gen).tolist()
        weights = (torch.rand(n, generator=gen) + 0.1).tolist()
        got = calibration.isotonic(values, weights)
        assert got == pytest.approx(_isotonic_reference(values, weights), abs=1e-9)
        assert all(b >= a - 1e-12 for a, b in zip(got, got[1:]))
        down = calibration.isotonic(values, weights, increasing=False)
        assert down == pytest.approx([-v for v in _isotonic_reference([-v for v in values], weights)], abs=1e-9)
    with pytest.raises(ValueError, match="weights"):
        calibration.isotonic([1.0, 2.0], [1.0])


def _count_forward_tokens(target, monkeypatch) -> list[int]:
    """The tokens of each of ``target``'s forwards from now on (the cost model's timed calls)."""
    calls: list[int] = []
    forward = target.forward

    def counting(*args, **kwargs):
        calls.append(int(kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", counting)
    return calls


def test_measured_curve_times_each_size_in_pairs_with_a_plain_step(cache_dir, monkeypatch):
    """Each pass times every n > 0 once, as a pair: the plain step and the tree back to back, which
    goes first flipping from pass to pass for each size; the sizes in a new random order each pass
    (a slow spell, or a forward slowed by the one before it, falls on different sizes). The warm-up
    pass is not kept, and a drift common to both forwards of a pair does not reach the curve."""
    target = tiny_target("llama")
    nodes, contexts, reps = [0, 1, 2, 4, 8], [8], 4
    calls = _count_forward_tokens(target, monkeypatch)
    per_pass = 2 * (len(nodes) - 1)

    class Timer:  # 10 ms + 1 ms a node, + a drift of 0-12 ms per pair, + 50 ms in the warm-up pass
        def __init__(self, device):
            self.count = 0

        def __call__(self, fn):
            fn()
            self.count += 1
            pair = (self.count - 1) // 2
            return 10.0 + (calls[-1] - 1) + (pair * 7) % 13 + (50.0 if self.count <= per_pass else 0.0)

    monkeypatch.setattr(profiling, "_Timer", Timer)
    cost = profiling.measure_cost_model(target, None, nodes=nodes, contexts=contexts, reps=reps)
    timed = [n - 1 for n in calls][-(reps + 1) * per_pass:]
    passes = [timed[i * per_pass:(i + 1) * per_pass] for i in range(reps + 1)]
    first = {}  # per size, which forward of its pair came first, pass by pass
    for p in passes:
        pairs = [tuple(p[i:i + 2]) for i in range(0, per_pass, 2)]
        assert all(0 in pair and sum(pair) > 0 for pair in pairs)  # a plain step and a tree
        assert sorted(sum(pair) for pair in pairs) == nodes[1:]
        for pair in pairs:
            first.setdefault(sum(pair), []).append(pair[0] == 0)
    assert all(order == [order[0], not order[0]] * 2 + [order[0]] for order in first.values())
    trees = [[sum(p[i:i + 2]) for i in range(0, per_pass, 2)] for p in passes]
    assert len({tuple(t) for t in trees}) == reps + 1  # shuffled each pass
    curve = cost.verify_ms[0]
    assert [c - curve[0] for c in curve] == pytest.approx([float(n) for n in nodes])
    assert 10.0 <= curve[0] < 23.0  # the plain step's fastest: never the warm-up pass's
    assert cost.meta["fit"] == "paired"


def test_curve_samples_keep_reps_pairs_per_size_and_context(cache_dir, monkeypatch):
    target = tiny_target("llama")

    class Timer:
        def __init__(self, device):
            self.count = 0

        def __call__(self, fn):
            fn()
            self.count += 1
            return float(self.count)  # 1, 2, 3, ...: a pair's two forwards are consecutive

    pairs = profiling._curve_samples(target, False, [0, 1, 3], [4, 8], 3, False, Timer(None), torch.Generator())
    assert len(pairs) == 2 and all(sorted(p) == [1, 3] for p in pairs)
    for per_context in pairs:
        for samples in per_context.values():
            assert len(samples) == 3
            assert all(abs(tree - plain) == 1 and min(tree, plain) > 8 for plain, tree in samples)  # no warm-up


def test_paired_fit_cancels_a_drifting_machine_and_a_stall():
    """A slow spell slows both forwards of a pair (drift up to 12 ms against 1 ms a node) and a stall
    one forward: the paired fit recovers the curve's shape exactly; the fastest of each point on its
    own does not."""
    nodes = [0, 1, 2, 4, 8]
    drift = {1: [9.0, 12.0, 3.0, 7.0, 10.0], 2: [0.5, 8.0, 6.0, 11.0, 9.0], 4: [4.0, 2.0, 12.0, 8.0, 7.0],
             8: [5.0, 10.0, 1.0, 9.0, 3.0]}
    pairs = {n: [(10.0 + d, 10.0 + d + n) for d in ds] for n, ds in drift.items()}
    pairs[4][1] = (pairs[4][1][0], pairs[4][1][1] + 40.0)  # a stall on one tree forward
    pairs[2][3] = (pairs[2][3][0] + 40.0, pairs[2][3][1])  # ... and on one plain step
    curve = profiling.fit_curve(nodes, pairs)
    assert [c - curve[0] for c in curve] == pytest.approx([float(n) for n in nodes])
    assert curve[0] == pytest.approx(10.5)  # the plain step's fastest time
    fastest = profiling.fit_curve(nodes, pairs, "fastest")
    assert [c - fastest[0] for c in fastest] != pytest.approx([float(n) for n in nodes], abs=0.5)


def test_fastest_fit_keeps_the_fastest_repetition_and_pools_noise():
    """``fit="fastest"``: each point is the fastest of its repetitions (noise only adds time), and a
    point that is still slow is pooled with its neighbours, not carried up the rest of the curve."""
    plan = {1: [15.0, 11.0, 19.0], 2: [10.5, 10.6, 30.0], 4: [12.0, 12.0, 12.0]}
    plains = [10.0, 14.0, 10.2]
    pairs = {n: list(zip(plains, ts)) for n, ts in plan.items()}
    # fastest: 10, 11, 10.5, 12 -> 11 and 10.5 pooled; the median with a running maximum
    # would give 10, 15, 15, 15
    assert profiling.fit_curve([0, 1, 2, 4], pairs, "fastest") == pytest.approx([10.0, 10.75, 10.75, 12.0])


def test_fit_curve_rejects_bad_input():
    pairs = {1: [(10.0, 11.0)], 2: [(10.0, 12.0)]}
    with pytest.raises(ValueError, match="fit must be one of"):
        profiling.fit_curve([0, 1, 2], pairs, "mean")
    with pytest.raises(ValueError, match=r"no pairs timed for tree sizes \[4\]"):
        profiling.fit_curve([0, 1, 2, 4], pairs)
    with pytest.raises(ValueError, match="starting at 0"):
        profiling.fit_curve([1, 2], pairs)
    with pytest.raises(ValueError, match="starting at 0"):
        profiling.fit_curve([0], {})
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="fit must be one of"):
        profiling.measure_cost_model(target, None, nodes=[0, 1], contexts=[8], reps=1, fit="mean")
    with pytest.raises(ValueError, match="tree size besides 0"):
        profiling.measure_cost_model(target, None, nodes=[0], contexts=[8], reps=1)
    with pytest.raises(ValueError, match="reps >= 1"):
        profiling.measure_cost_model(target, None, nodes=[0, 2], contexts=[8], reps=0)


# the calibrator ---------------------------------------------------------------------------------
def test_calibrator_learns_and_stays_monotone():
    cal = AcceptanceCalibrator()
    gen = torch.Generator().manual_seed(0)
    scores = -torch.rand(20000, generator=gen) * 4
    true = torch.where(scores > -1.0, 0.6, 0.05)        # over-confident drafter at low scores
    hit = torch.rand(20000, generator=gen) < true
    cal.update(scores, hit)
    p = cal.predict(torch.tensor([-0.6, -0.9, -1.2, -3.5]))
    assert p[:2].sub(0.6).abs().max() < 0.06 and p[2:].sub(0.05).abs().max() < 0.03
    probs = cal.probabilities()
    assert torch.all(probs[1:] <= probs[:-1])
    # unseen bins keep the prior: exp of the bin's midpoint
    fresh = AcceptanceCalibrator()
    assert float(fresh.predict(torch.tensor([-0.6]))) == pytest.approx(float(torch.tensor(-0.625).exp()), rel=1e-5)
    assert float(fresh.predict(torch.tensor([float("nan")]))) < 1e-3     # NaN ranks as the worst score


def test_calibrator_bins_and_numpy_path():
    """The NumPy binning is the bin count rule ``sum(score <= edge)`` (edges themselves, -inf,
    +inf, NaN as the worst), and updates through NumPy arrays equal updates through tensors."""
    cal = AcceptanceCalibrator()
    edges = cal.edges
    gen = torch.Generator().manual_seed(1)
    scores = torch.cat([-torch.rand(500, generator=gen) * 12, edges, edges - 1e-6, edges + 1e-6,
                        torch.tensor([0.0, 0.5, float("-inf"), float("inf"), float("nan")])])
    expected = (scores.nan_to_num(nan=-1e30)[:, None] <= edges).sum(-1)
    assert torch.equal(cal.bin_of(scores), expected)
    hits = torch.rand(scores.shape, generator=gen) < 0.4
    other = AcceptanceCalibrator()
    cal.update(scores, hits)
    other.update(scores.numpy(), hits.numpy())
    assert torch.equal(cal.hits, other.hits) and torch.equal(cal.trials, other.trials)
    assert torch.equal(cal.trials, torch.bincount(expected, minlength=len(edges) + 1).double())
    before = cal.probabilities()
    cal.update(torch.tensor([-0.01]), torch.tensor([False]))  # the cached probabilities follow the counts
    assert not torch.equal(cal.probabilities(), before)
    assert torch.equal(cal.predict(scores), torch.from_numpy(cal.predict_np(scores.numpy())))


def test_calibrator_bad_bins():
    with pytest.raises(ValueError, match="negative"):
        AcceptanceCalibrator(bins=(0.5, -1.0))
    with pytest.raises(ValueError, match="prior_weight"):
        AcceptanceCalibrator(prior_weight=0)


def _level_rounds(level, true_factor, rounds, gen):
    """Rounds of 40 nodes at depths 1-4, calibrated p in [0.2, 0.9], each accepted with
    probability p * true_factor**depth."""
    for _ in range(rounds):
        depths = torch.randint(1, 5, (40,), generator=gen)
        p = 0.2 + 0.7 * torch.rand(40, generator=gen)
        truth = (p * true_factor ** depths.double()).clamp(max=1.0)
        level.update(p, depths, torch.rand(40, generator=gen, dtype=torch.float64) < truth)


def test_acceptance_level_fits_the_factor():
    gen = torch.Generator().manual_seed(0)
    level = AcceptanceLevel(decay=0.99)
    assert level.factor == 1.0
    p, d = torch.tensor([0.5, 0.5, 0.99]), torch.tensor([1, 2, 3])
    assert torch.equal(level.scale(p, d), p)                   # no evidence: the calibration as it is
    _level_rounds(level, 0.6, 200, gen)
    assert level.factor == pytest.approx(0.6, abs=0.05)
    assert level.scale(p, d)[:2].tolist() == pytest.approx([0.5 * level.factor, 0.5 * level.factor ** 2], rel=1e-5)
    # by hand: one depth-1 node of p = 0.5 missed, prior 2 -> 0.5 g + 2 g = 2, g = 0.8
    one = AcceptanceLevel(prior=2.0)
    one.update(torch.tensor([0.5]), torch.tensor([1]), torch.tensor([False]))
    assert one.factor == pytest.approx(0.8, abs=1e-6)
    # bounds and the cap on probabilities
    good = AcceptanceLevel(bounds=(0.5, 1.5))  # 40 depth-1 nodes of p = 0.2, all accepted: g = 42 / 10 without bounds
    good.update(torch.full((40,), 0.2), torch.ones(40, dtype=torch.int64), torch.ones(40, dtype=torch.bool))
    assert good.factor == 1.5 and float(good.scale(torch.tensor([0.9]), torch.tensor([2]))) == pytest.approx(good.p_max)


def test_acceptance_level_forgets_a_hard_start():
    gen = torch.Generator().manual_seed(1)
    level = AcceptanceLevel()  # the decoder's default decay
    _level_rounds(level, 0.3, 10, gen)
    assert level.factor < 0.5
    _level_rounds(level, 1.0, 15, gen)
    assert level.factor == pytest.approx(1.0, abs=0.12)


def test_acceptance_level_bad_input():
    for kw, match in [({"decay": 1.0}, "decay"), ({"prior": 0.0}, "prior"), ({"bounds": (1.2, 2.0)}, "bounds"),
                      ({"p_max": 0.0}, "p_max")]:
        with pytest.raises(ValueError, match=match):
            AcceptanceLevel(**kw)
    with pytest.raises(ValueError, match="depths"):
        AcceptanceLevel().update(torch.tensor([0.5]), torch.tensor([0]), torch.tensor([True]))


# measuring and the cache ------------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    return tmp_path


def test_measure_cost_model_tiny(cache_dir):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    builders = {m: SpeculativeDecoder(target, drafter, m, budget=8, width=4, K=8).build_tree for m in ("ddtree", "dartree")}
    cost = profiling.measure_cost_model(target, drafter, methods=["ddtree", "dartree", "chain"], nodes=[0, 2, 8],
                                      contexts=[8, 32], reps=1, tree_builders=builders)
    assert cost.nodes == [0, 2, 8] and cost.contexts == [8, 32]
    for row in cost.verify_ms:
        assert all(b >= a > 0 for a, b in zip(row, row[1:]))
    assert cost.draft_ms > 0 and set(cost.tree_ms) == {"ddtree", "dartree"}


def test_drafter_pass_is_timed_as_the_decoder_runs_it(cache_dir, monkeypatch):
    """The decoder keeps every committed slot's drafter keys and values, so a round's pass gets them
    (``context_kv``) and projects only its block; the cost model must time that pass, not one that
    re-projects the whole context every call (several times dearer on a CPU)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    calls = []
    forward = type(drafter).forward

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("context_kv") is not None)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "forward", spy)
    profiling.measure_cost_model(target, drafter, methods=["chain"], nodes=[0, 2], contexts=[8, 32], reps=2)
    assert calls and all(calls)


def test_cache_is_keyed_and_invalidated(cache_dir, monkeypatch):
    calls = []

    def fake_measure(target, drafter, methods, nodes, contexts, reps, progress, tree_builders):
        calls.append(torch.get_num_threads())
        return CostModel(nodes=list(nodes), contexts=list(contexts),
                         verify_ms=[[1.0 + n for n in nodes] for _ in contexts])

    monkeypatch.setattr(profiling, "measure_cost_model", fake_measure)
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    kw = dict(methods=["dartree"], nodes=[0, 4], contexts=[16])
    first = profiling.cached_cost_model(target, drafter, **kw)
    assert len(calls) == 1
    assert profiling.cached_cost_model(target, drafter, **kw) == first and len(calls) == 1   # read back
    profiling.cached_cost_model(target, drafter, refresh=True, **kw)
    assert len(calls) == 2
    threads = torch.get_num_threads()
    try:                                                  # another thread count is another machine setup
        torch.set_num_threads(threads + 1)
        profiling.cached_cost_model(target, drafter, **kw)
        assert len(calls) == 3
    finally:
        torch.set_num_threads(threads)
    profiling.cached_cost_model(target.to(torch.bfloat16), drafter, **kw)      # another dtype
    assert len(calls) == 4
    target.to(torch.float32)
    other = tiny_target("llama", layers=2)                                    # another model
    profiling.cached_cost_model(other, tiny_drafter(other), **kw)
    assert len(calls) == 5
    profiling.cached_cost_model(target, drafter, methods=["ddtree"], nodes=[0, 4], contexts=[16])  # other methods
    assert len(calls) == 6
    # a corrupted or foreign file is measured again, not trusted
    path = profiling._key_path(profiling.cost_key(target, drafter, "cpu", [0, 4], [16], ["dartree"]))
    with open(path, "w") as f:
        f.write("{not json")
    profiling.cached_cost_model(target, drafter, **kw)
    assert len(calls) == 7
    saved = json.load(open(path))
    saved["meta"]["key"]["torch"] = "0.0"
    json.dump(saved, open(path, "w"))
    profiling.cached_cost_model(target, drafter, **kw)
    assert len(calls) == 8
    assert len(os.listdir(cache_dir / "cost")) == 5   # one file per key


def test_choose_dtype_is_cached(cache_dir, monkeypatch):
    times = {torch.float32: 5.0, torch.bfloat16: 3.0}
    calls = []

    def fake_forward(model, tokens, reps, context=64):
        calls.append(tokens)
        return times[next(model.parameters()).dtype]

    monkeypatch.setattr(profiling, "forward_ms", fake_forward)
    target = tiny_target("llama")
    dtype, ms = profiling.choose_dtype(target, tokens=(1, 9))
    assert dtype == torch.bfloat16 and ms == {"float32": 10.0, "bfloat16": 6.0}
    assert next(target.parameters()).dtype == torch.float32          # measured on a copy
    assert len(calls) == 3 * 2 * 2                    # every dtype and size, 3 repetitions in turn
    assert profiling.choose_dtype(target, tokens=(1, 9))[0] == torch.bfloat16 and len(calls) == 12
    times[torch.bfloat16] = 8.0
    assert profiling.choose_dtype(target, tokens=(1, 9), refresh=True)[0] == torch.float32


# decoding with budget="auto" -------------------------------------------------------------------
TREES_PAY = CostModel.from_curve({0: 10.0, 4096: 10.5}, draft_ms=0.1)     # nodes nearly free: big trees
PLAIN_WINS = CostModel.from_curve({0: 10.0, 1: 30.0, 4096: 40.0}, draft_ms=5.0)
BLOCK_AUTO_METHODS = [m for m in AUTO_METHODS if m != "lookup" and m not in EAGLE3_METHODS]  # (EAGLE-3: test_eagle3.py)


@pytest.mark.parametrize("estimator", ["score", "adaptive"])
def test_calibration_feeds_exactly_the_verified_nodes(setup, estimator):
    """A hand-built round: the calibrator (and the adaptive level) learn from the verified draft
    nodes alone, hits on the accepted path; not the root, padding or a grafted lookup node
    (score -inf). A round with no verified draft feeds the depth-1 nodes against the target's
    first token."""
    from dartree_ext.tree import Tree
    target, drafter, _, _ = setup
    dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", estimator=estimator, cost_model=TREES_PAY)
    dec.calibrator, dec.sizing.level = DepthCalibrator.fresh(), AcceptanceLevel()
    ninf = float("-inf")
    tree = Tree(tokens=torch.tensor([[5, 6, 7, 8, 9], [5, 1, 2, 3, 0]]),
                parents=torch.tensor([[-1, 0, 0, 1, 0], [-1, 0, 1, 2, -1]], dtype=torch.int32),
                depths=torch.tensor([[0, 1, 1, 2, 1], [0, 1, 2, 3, -1]], dtype=torch.int32),
                scores=torch.tensor([[0.0, -0.3, -1.2, -0.6, ninf], [0.0, -0.04, -2.2, -4.5, ninf]]),
                num_nodes=torch.tensor([5, 4], dtype=torch.int32))
    accept = torch.tensor([[0, 1, 3, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32)
    dec.sizing.calibrate(tree, accept)
    want = [AcceptanceCalibrator() for _ in range(3)]                  # depth 1, 2, >= 3
    want[0].update(torch.tensor([-0.3, -1.2, -0.04]), torch.tensor([1, 0, 1.0]))
    want[1].update(torch.tensor([-0.6, -2.2]), torch.tensor([1, 0.0]))
    want[2].update(torch.tensor([-4.5]), torch.tensor([0.0]))
    for got, w in zip(dec.calibrator.classes, want):
        assert torch.equal(got.trials, w.trials) and torch.equal(got.hits, w.hits)
    if estimator == "adaptive":
        want_level = AcceptanceLevel()
        want_level.update(AcceptanceCalibrator().predict(torch.tensor([-0.3, -1.2, -0.6, -0.04, -2.2, -4.5])),
                          torch.tensor([1, 1, 2, 1, 2, 3]), torch.tensor([1, 0, 1, 1, 0, 0.0]))
        assert dec.sizing.level.factor == pytest.approx(want_level.factor) and dec.sizing.level.factor != 1.0
    dec.sizing.calibrate_unverified(tree, torch.tensor([7, 3]))   # row 0: node 2 right; row 1: node 1 wrong
    want[0].update(torch.tensor([-0.3, -1.2, ninf, -0.04]), torch.tensor([0, 1, 0, 0.0]))
    for got, w in zip(dec.calibrator.classes, want):
        assert torch.equal(got.trials, w.trials) and torch.equal(got.hits, w.hits)


def test_given_calibrator_serves_every_depth_before_and_during_generate(setup):
    """A plain AcceptanceCalibrator given to the constructor is the calibrator of every depth,
    from the start (not only once generate runs)."""
    from dartree_ext.tree import Tree
    target, drafter, prompts, refs = setup
    given = AcceptanceCalibrator()
    dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", calibrator=given, cost_model=TREES_PAY)
    assert isinstance(dec.calibrator, DepthCalibrator) and dec.calibrator.classes == [given]
    tree = Tree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, 1]], dtype=torch.int32),
                depths=torch.tensor([[0, 1, 2]], dtype=torch.int32), scores=torch.tensor([[0.0, -0.1, -0.4]]),
                num_nodes=torch.tensor([3], dtype=torch.int32))
    assert dec.expected_accepted(tree).shape == (3,)
    check_greedy(dec, prompts, refs, NEW)
    assert dec.calibrator.classes == [given] and float(given.trials.sum()) > 0


def test_crop_checks_the_cache_layers():
    """The crop alone (a round that kept its roots in place) still refuses sliding-window layers."""
    from types import SimpleNamespace
    from dartree_ext.decoding.cache import crop_cache_
    layer = SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2), is_sliding=True)
    with pytest.raises(NotImplementedError, match="sliding"):
        crop_cache_(SimpleNamespace(layers=[layer]), 3)
    with pytest.raises(TypeError, match="transformers Cache"):
        crop_cache_(object(), 3)
    layer.is_sliding = False
    cache = SimpleNamespace(layers=[layer])
    assert crop_cache_(cache, 3) is cache and layer.keys.shape[2] == 3 and layer.values.shape[2] == 3


def test_crop_gives_the_views_slicing_gives():
    """Every layer cut in one native call (narrow_all): views of the same storage, equal to slicing;
    layers already short enough left as they are; a negative length refused."""
    from types import SimpleNamespace
    from dartree_ext._C import narrow_all
    from dartree_ext.decoding.cache import crop_cache_
    gen = torch.Generator().manual_seed(0)
    layers = [SimpleNamespace(keys=torch.randn(2, 3, 9, 4, generator=gen), values=torch.randn(2, 3, 9, 5, generator=gen)
                              .bfloat16()) for _ in range(4)]
    layers[1].keys = layers[1].keys.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous layout
    before = [(layer.keys, layer.values) for layer in layers]
    crop_cache_(SimpleNamespace(layers=layers), 6)
    for layer, (k, v) in zip(layers, before):
        assert torch.equal(layer.keys, k[:, :, :6]) and torch.equal(layer.values, v[:, :, :6])
        assert layer.keys.stride() == k[:, :, :6].stride() and layer.keys.data_ptr() == k.data_ptr()
        assert layer.values._base is v or layer.values.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    same = crop_cache_(SimpleNamespace(layers=layers), 8)
    assert all(layer.keys.shape[2] == 6 for layer in same.layers)      # shorter already: unchanged
    t = torch.arange(10.0)
    short = t[:3]
    cut, kept = narrow_all([t, short], 0, 5)
    assert torch.equal(cut, t[:5]) and kept is short and narrow_all([t], 0, 20)[0] is t
    with pytest.raises(ValueError, match="length must be >= 0"):
        narrow_all([t], 0, -1)


def test_calibrator_list_paths_match_numpy_paths():
    """The decoder's per-round plain-Python paths (bins, probabilities, updates) give what the
    NumPy paths give: random scores with the bin edges themselves, -inf, NaN and depths past the
    last class; counts after the same updates equal."""
    gen = np.random.default_rng(0)
    edges = np.asarray(AcceptanceCalibrator.DEFAULT_BINS, dtype=np.float32)
    by_list, by_np = DepthCalibrator.fresh(3), DepthCalibrator.fresh(3)
    for _ in range(20):
        n = int(gen.integers(0, 40))
        scores = np.concatenate([-gen.exponential(1.5, n), gen.choice(edges, 5), [-np.inf, np.nan, 0.0]])
        scores = scores.astype(np.float32)
        depths = gen.integers(1, 7, scores.size)
        hits = gen.random(scores.size) < 0.4
        want = by_np.predict_np(scores, depths)
        got = by_list.predict_list(scores.tolist(), depths.tolist())
        assert np.array_equal(np.asarray(got, dtype=np.float32), want)
        assert by_list.classes[0].bin_list(scores.tolist()) == by_np.classes[0].bins_np(scores).tolist()
        by_np.update(scores, hits, depths)
        by_list.update_list(scores.tolist(), hits.tolist(), depths.tolist())
        assert torch.equal(by_list.trials, by_np.trials) and torch.equal(by_list.hits, by_np.hits)
        for a, b in zip(by_list.classes, by_np.classes):
            assert list(a.probabilities_list()) == b.probabilities_np().tolist()


def test_depth_calibrator_classes_and_saved_states():
    """A depth class per depth up to the last, which takes every deeper node; one lookup gives each
    node its class's probability; a state saved without depths starts every class; bad input."""
    cal = DepthCalibrator.fresh(2)
    cal.update(np.full(50, -0.3, dtype=np.float32), np.ones(50), np.ones(50))          # depth 1: always
    cal.update(np.full(50, -0.3, dtype=np.float32), np.zeros(50), np.full(50, 4))      # depth 4 -> class 2: never
    p = cal.predict_np(np.array([-0.3, -0.3, -0.3], dtype=np.float32), np.array([1, 2, 7]))
    assert p[0] > 0.9 and p[1] < 0.2 and p[2] == p[1]  # (pooled with the worse bins' priors: isotonic)
    assert cal.trials.shape == (2, 16) and float(cal.trials.sum()) == 100
    again = DepthCalibrator.from_state(json.loads(json.dumps(cal.state_dict())))
    assert torch.equal(again.hits, cal.hits) and torch.equal(again.trials, cal.trials)
    flat = DepthCalibrator.from_state(cal.classes[0].state_dict(), depths=3)    # counts without depths
    assert len(flat.classes) == 3 and all(torch.equal(c.trials, cal.classes[0].trials) for c in flat.classes)
    with pytest.raises(ValueError, match="same score bins"):
        DepthCalibrator([AcceptanceCalibrator(), AcceptanceCalibrator(bins=(-1.0, -2.0))])
    with pytest.raises(ValueError, match="calibration state"):
        DepthCalibrator.from_state({"by_depth": []})


@pytest.mark.parametrize("method", BLOCK_AUTO_METHODS)
def test_auto_budget_lossless_with_long_paths(setup, method):
    target, drafter, prompts, refs = setup
    oracle = LookupDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    dec = SpeculativeDecoder(target, oracle, method, budget="auto", width=4, K=8, max_budget=24, cost_model=TREES_PAY)
    out = check_greedy(dec, prompts, refs, NEW)
    assert out.stats.tau > 2.0 and out.stats.plain_rounds == 0
    assert max(out.stats.tree_nodes) <= 24
    assert dec.calibrator.trials.sum() > 0
    # the chooser's prediction is recorded beside what each round gave and took
    st = out.stats
    assert 0 < st.auto_rounds <= st.rounds                  # (request rounds: rows x batch rounds)
    assert st.measured_tokens == sum(sum(r.accepted) for r in st.requests) + st.rounds
    assert st.rounds < st.predicted_tokens <= st.rounds * 25
    rounds = st.auto_rounds
    assert 10.1 * rounds <= st.predicted_ms <= 10.6 * rounds + 1e-6   # verify 10-10.5 + draft 0.1, no overhead
    assert st.measured_ms > 0 and st.summary()["auto_check"]["rounds"] == rounds


def test_running_costs_follow_the_rounds(setup):
    """A measured cost model (overhead_ms None) is corrected by the rounds: the tiny model's
    rounds take well under the curve's 100 ms (a curve of 10 ms was too close on a machine
    whose cores another job held), so the verify scale falls towards its floor of 1/3 and the
    drafter pass plus tree is what the rounds took; a given model (overhead_ms set) is not
    touched. Both stay lossless."""
    import dataclasses
    target, drafter, prompts, refs = setup
    oracle = LookupDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    measured = dataclasses.replace(CostModel.from_curve({0: 100.0, 4096: 105.0}, draft_ms=0.1), overhead_ms=None)
    dec = SpeculativeDecoder(target, oracle, "dartree", budget="auto", width=4, K=8, max_budget=24, cost_model=measured)
    check_greedy(dec, prompts, refs, NEW)
    overhead, scale, drafted = dec.sizing.running_costs()
    assert dec.sizing.costs.verify_scale is not None and 1 / 3 <= scale < 0.6
    assert drafted == dec.sizing.costs.drafted_ms and 0 < drafted != TREES_PAY.draft_ms + TREES_PAY.tree("dartree")
    assert overhead == dec.sizing.costs.overhead_ms > 0
    given = SpeculativeDecoder(target, oracle, "dartree", budget="auto", width=4, K=8, max_budget=24,
                               cost_model=TREES_PAY)
    check_greedy(given, prompts, refs, NEW)
    assert given.sizing.running_costs() == (TREES_PAY.overhead_ms, 1.0, TREES_PAY.draft_ms + TREES_PAY.tree("dartree"))
    assert given.sizing.costs.verify_scale is None and given.sizing.costs.drafted_ms is None


@pytest.mark.parametrize("method", BLOCK_AUTO_METHODS)
def test_auto_budget_lossless_when_plain_decoding_wins(setup, method):
    target, drafter, prompts, refs = setup
    dec = SpeculativeDecoder(target, drafter, method, budget="auto", width=4, K=8, cost_model=PLAIN_WINS,
                             lookup=0)  # the drafter alone (a context continuation can pay here)
    passes = []
    forward = drafter.forward
    drafter.forward = lambda *a, **kw: passes.append((dec.sizing.backoff, kw.get("positions"))) or forward(*a, **kw)
    try:
        out = check_greedy(dec, prompts, refs, NEW)
    finally:
        del drafter.forward
    assert out.stats.plain_rounds > out.stats.rounds // 2
    assert out.stats.tau < 1.3
    # after a plain round the drafter is skipped for 1, 2, 4, ... rounds: few drafter passes
    assert 0 < len(passes) < out.stats.rounds // 3
    # the first pass drafts every position; a probe after plain steps drafts PROBE_DEPTH at most
    assert passes[0] == (0, drafter.config.block_size - 1) and passes[0][1] > PROBE_DEPTH
    probes = [p for backoff, p in passes if backoff]
    assert probes and all(p <= PROBE_DEPTH for p in probes)


def test_auto_budget_picks_per_round_sizes(setup):
    """A curve with a step at 6 nodes: the trees stay at most 6 nodes once calibrated."""
    target, drafter, prompts, refs = setup
    oracle = LookupDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    step = CostModel.from_curve({0: 10.0, 6: 10.0, 7: 100.0, 64: 200.0}, draft_ms=0.1)
    dec = SpeculativeDecoder(target, oracle, "ddtree", budget="auto", K=8, cost_model=step)
    out = check_greedy(dec, prompts, refs, NEW)
    assert max(out.stats.tree_nodes) <= 6 and out.stats.tau > 1.5


def test_auto_budget_bad_input(setup):
    target, drafter, _, _ = setup
    with pytest.raises(ValueError, match="'auto'"):
        SpeculativeDecoder(target, drafter, "dartree", budget="big")
    with pytest.raises(ValueError, match="supports"):
        SpeculativeDecoder(target, drafter, "seq_heap", budget="auto")
    with pytest.raises(ValueError, match="max_budget"):
        SpeculativeDecoder(target, drafter, "dartree", budget="auto", max_budget=0)
    with pytest.raises(TypeError, match="CostModel"):
        SpeculativeDecoder(target, drafter, "dartree", budget="auto", cost_model={0: 1.0})


# saved calibration ------------------------------------------------------------------------------
def test_calibration_state_round_trip_and_cap():
    cal = AcceptanceCalibrator()
    cal.update(torch.tensor([-0.6] * 200 + [-3.5] * 100), torch.tensor([True] * 150 + [False] * 50 + [False] * 100))
    state = json.loads(json.dumps(cal.state_dict()))
    again = AcceptanceCalibrator.from_state(state)
    assert torch.equal(again.probabilities(), cal.probabilities())
    capped = AcceptanceCalibrator.from_state(state, max_trials=32)
    assert float(capped.trials.max()) == pytest.approx(32.0)
    assert float(capped.predict(torch.tensor([-0.6]))) == pytest.approx(float(cal.predict(torch.tensor([-0.6]))),
                                                                           abs=0.05)
    with pytest.raises(ValueError, match="calibration state"):
        AcceptanceCalibrator.from_state({"bins": state["bins"], "hits": [1.0], "trials": [0.5]})
    with pytest.raises(ValueError, match="calibration state"):
        AcceptanceCalibrator.from_state({"hits": []})


def test_decoder_starts_from_the_drafters_saved_calibration(setup, tmp_path):
    """A drafter saved with ``calibration.json`` gives each method and regime (greedy / sample)
    its own starting counts; a bad entry is ignored with a warning."""
    from dartree_ext.models import BlockDrafter
    target, drafter, prompts, refs = setup
    sure = AcceptanceCalibrator()
    sure.update(torch.full((400,), -0.6), torch.ones(400, dtype=torch.bool))
    drafter = BlockDrafter.from_pretrained(_saved(drafter, tmp_path, {"ddtree@greedy": sure.state_dict(),
                                                                       "dartree@greedy": {"hits": [1]}}), target)
    assert set(drafter.calibration) == {"ddtree@greedy", "dartree@greedy"}
    dec = SpeculativeDecoder(target, drafter, "ddtree", budget="auto", K=8, cost_model=TREES_PAY)
    for depth in (1, 2, 3):                                                     # counts without depths start each class
        assert float(dec.calibrator.predict_np(np.float32([-0.6]), np.array([depth]))[0]) > 0.85  # (prior: 0.54)
    assert dec.calibrator.trials.sum(1).tolist() == pytest.approx([32.0] * 3)   # capped
    check_greedy(dec, prompts, refs, NEW)
    dec.generate(prompts[0][None], max_new_tokens=2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert set(dec.learned.calibrators) == {"greedy", "sample"}
    assert float(dec.learned.calibrators["sample"].predict_np(np.float32([-0.6]), np.array([1]))[0]) < 0.6  # none saved
    bad = SpeculativeDecoder(target, drafter, "dartree", budget="auto", K=8, cost_model=TREES_PAY)
    assert float(bad.calibrator.trials.sum()) == 0.0


def _saved(drafter, tmp_path, calibration):
    drafter.calibration = calibration
    try:
        drafter.save_pretrained(tmp_path / "d")
    finally:
        drafter.calibration = {}
    return tmp_path / "d"


def _paths(tree, row):
    """The token path (root excluded) of every node of ``tree``'s row, with its score."""
    n = int(tree.num_nodes[row])
    parents, tokens, scores = tree.parents[row].tolist(), tree.tokens[row].tolist(), tree.scores[row].tolist()
    out = {}
    for i in range(1, n):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out[tuple(reversed(path))] = round(scores[i], 5)
    return out


@pytest.mark.parametrize("method", ["dartree", "ddtree"])
def test_build_cap_keeps_the_best_nodes(setup, method):
    """A round's tree built for a cap of c nodes (narrower, smaller) has the same best n <= c
    nodes, with the same scores, as the full build: the chooser sees the same choices."""
    from dartree_ext.tree import prune
    target, drafter, _, _ = setup
    dec = SpeculativeDecoder(target, drafter, method, budget="auto", width=10, K=12, lookup=0,
                             cost_model=CostModel.from_curve({0: 1.0, 64: 2.0}))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, target.config.hidden_size, generator=gen)
    base = torch.randn(3, 5, target.config.vocab_size, generator=gen) * 3
    root = torch.tensor([1, 2, 3])
    full = dec.build_tree(hidden, base, root)
    assert int(full.num_nodes.max()) > 17                                 # more than any cap below
    for cap in (1, 3, 7, 16):
        small = dec.build_tree(hidden, base, root, cap=cap)
        assert int(small.num_nodes.max()) <= cap + 1
        for n in range(1, cap + 1):
            a, b = prune(full, n), prune(small, n)
            for row in range(3):
                assert _paths(a, row) == _paths(b, row), (cap, n, row)
    # a cap at or above the budget changes nothing
    assert _paths(dec.build_tree(hidden, base, root, cap=64), 0) == _paths(full, 0)


def test_build_cap_follows_recent_sizes(setup):
    target, drafter, prompts, refs = setup
    oracle = LookupDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    step = CostModel.from_curve({0: 10.0, 6: 10.0, 7: 100.0, 64: 200.0}, draft_ms=0.1)  # 3 rows: n <= 1 pays
    dec = SpeculativeDecoder(target, oracle, "ddtree", budget="auto", K=8, lookup=0, cost_model=step)
    assert dec.sizing.build_cap() is None
    dec.sizing.recent_sizes = [1, 3, 2]
    assert dec.sizing.build_cap() is None                                       # fewer than 4 rounds seen
    dec.sizing.recent_sizes = [1, 3, 2, 2]
    assert dec.sizing.build_cap() == 10
    dec.sizing.recent_sizes = [40] * 4
    assert dec.sizing.build_cap() == 64                                         # never above max_budget
    dec.sizing.backoff = 2                                                      # a probe after plain steps
    assert dec.sizing.build_cap() == 16 and dec.sizing.draft_positions(15) == 4
    dec.sizing.backoff = 0
    caps = []
    build = dec.build_tree
    dec.build_tree = lambda *a, **kw: caps.append(kw.get("cap")) or build(*a, **kw)
    out = check_greedy(dec, prompts, refs, NEW)                           # lossless with the cap in use
    assert max(out.stats.tree_nodes) <= 2 and out.stats.tau > 1.5
    assert caps[0] is None and caps[-1] is not None and caps[-1] <= 2 * 2 + 4


def test_backoff_and_running_average_helpers():
    from dartree_ext.decoding.cost import MAX_SKIP_ROUNDS, next_backoff, running_average
    seq, b = [], 0
    for _ in range(7):
        b = next_backoff(b)
        seq.append(b)
    assert seq == [1, 2, 4, 8, 16, 16, 16] and MAX_SKIP_ROUNDS == 16
    assert next_backoff(3, cap=5) == 5
    assert running_average(None, 7.0, 0.2) == 7.0
    assert running_average(10.0, 20.0, 0.2) == pytest.approx(12.0)
