"""The static-shape round (StaticRound): lossless against plain greedy decoding, the compiled round
equal to the eager one token for token, sampling from one uniform number per node, and bad input."""
from __future__ import annotations

import math

import pytest
import torch

from dartree_ext.decoding import StaticRound
from dartree_ext.decoding.static_round import sample_tokens
from dartree_ext.models import LookupDrafter

from models import greedy_reference, tiny_drafter, tiny_target


def _prompts(vocab: int, lengths=(7, 12), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("lengths", [(7, 12), (1, 5), (1,), (9,)])
def test_static_round_is_lossless_with_long_accepted_paths(lengths):
    """An oracle drafter gets long paths accepted, so compaction moves many entries per round
    (left padding and the gap before a shorter row's tree included); greedy output equals the
    target's own."""
    target = tiny_target()
    prompts = _prompts(97, lengths)
    refs = [greedy_reference(target, p, 24) for p in prompts]
    oracle = LookupDrafter(tiny_drafter(target), [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    rnd = StaticRound(target, oracle, max_length=64, batch_size=len(prompts), budget=8, width=3, K=4)
    out, stats = rnd.generate(prompts, 24)
    for got, ref in zip(out, refs):
        assert torch.equal(got, ref)
    assert stats["tau"] > 2.0, stats  # the oracle must be accepted, or compaction went untested


def test_finished_rows_stop_moving_the_write_slot():
    """Rows that accept very differently (an oracle for one row only): a finished row's caches
    freeze, so a cache sized longest prompt - 1 + max_new_tokens + B holds the decode."""
    target = tiny_target()
    prompts = _prompts(97, (7, 7), seed=3)
    refs = [greedy_reference(target, p, 24) for p in prompts]
    oracle = LookupDrafter(tiny_drafter(target), [torch.cat([prompts[0], refs[0]])], miss=0.0)
    rnd = StaticRound(target, oracle, max_length=6 + 24 + 8, batch_size=2, budget=8, width=3, K=4)
    out, info = rnd.generate(prompts, 24)
    for got, ref in zip(out, refs):
        assert torch.equal(got, ref)
    # the eager decoder's statistics: the oracle's row finishes in fewer calls, and leaves
    stats = info["stats"]
    fast, slow = stats.requests
    assert [r.new_tokens for r in stats.requests] == [24, 24] and {r.finish_reason for r in stats.requests} == {"length"}
    assert fast.rounds < slow.rounds == info["rounds"] + info["plain_steps"]
    assert all(sum(r.accepted) + r.rounds >= 24 for r in stats.requests) and stats.tau > 1.0
    assert info["tau"] == pytest.approx(48 / (fast.rounds + slow.rounds))
    assert stats.time["prefill"] > 0 and stats.time["verify"] > 0


def test_static_plain_steps_equal_greedy_decoding():
    target = tiny_target()
    prompts = _prompts(97)
    rnd = StaticRound(target, tiny_drafter(target), max_length=48, batch_size=2)
    out, stats = rnd.generate(prompts, 12, plain=True)
    for got, p in zip(out, prompts):
        assert torch.equal(got, greedy_reference(target, p, 12))
    assert stats["tau"] == 1.0


def test_adaptive_decoding_is_lossless_and_switches():
    """adaptive=True mixes rounds and plain steps (which it picks depends on timings, so only
    the forced first plain step is asserted); the output is the target's greedy output for a
    random drafter and an oracle alike."""
    target = tiny_target()
    prompts = _prompts(97)
    refs = [greedy_reference(target, p, 30) for p in prompts]
    for drafter in (tiny_drafter(target),
                    LookupDrafter(tiny_drafter(target), [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)):
        rnd = StaticRound(target, drafter, max_length=80, batch_size=2, budget=8, width=3, K=4)
        out, stats = rnd.generate(prompts, 30, adaptive=True)
        for got, ref in zip(out, refs):
            assert torch.equal(got, ref)
        assert stats["rounds"] >= 1 and stats["plain_steps"] >= 1, stats  # the first round is followed by one


def test_plain_steps_keep_the_drafter_context():
    """Plain steps with context=True leave the drafter's context as a prefill of the longer
    prompt would (float32: up to rounding)."""
    target = tiny_target()
    prompt = _prompts(97, (9,))[0]
    rnd = StaticRound(target, tiny_drafter(target), max_length=40, batch_size=1, budget=4)
    rnd.prefill([prompt])
    new = [int(rnd.plain_step(context=True)[0][0, 0]) for _ in range(5)]
    stepped = [kv.clone() for kv in rnd.context_kv]
    length = int(rnd.length[0])
    rnd.prefill([torch.cat([prompt, torch.tensor(new)])])
    assert int(rnd.length[0]) == length
    for a, b in zip(stepped, rnd.context_kv):
        torch.testing.assert_close(a[:, :length], b[:, :length], atol=1e-5, rtol=1e-5)


def test_pacer_backs_off_and_probes():
    from dartree_ext.decoding.static_round import _Pacer
    pacer = _Pacer()
    assert pacer.round_next()
    pacer.observe(True, 2.0, 1.0)         # 2 tokens in 1 s
    assert not pacer.round_next()         # one plain step to measure
    pacer.observe(False, 1.0, 0.25)       # 4 tokens/s plain: rounds lose
    for _ in range(pacer.MIN_ROUNDS - 2):  # but no back-off before MIN_ROUNDS rounds
        assert pacer.round_next()
        pacer.observe(True, 2.0, 1.0)
    assert pacer.round_next()
    pacer.observe(True, 2.0, 1.0)
    assert [pacer.round_next() for _ in range(2)] == [False, True]         # back off 1
    pacer.observe(True, 2.0, 1.0)
    assert [pacer.round_next() for _ in range(3)] == [False, False, True]  # then 2
    for _ in range(3):
        pacer.observe(True, 60.0, 1.0)    # rounds that pay: the average tokens climb over 4
    assert pacer.backoff == 0 and pacer.round_next()


def test_static_round_stops_at_eos_and_reuses_its_buffers():
    target = tiny_target()
    prompts = _prompts(97)
    rnd = StaticRound(target, tiny_drafter(target), max_length=64, batch_size=2, budget=6)
    first, _ = rnd.generate(prompts, 16)
    stop = int(first[0][3])
    again, _ = rnd.generate(prompts, 16, eos_token_id=stop)  # a second call starts clean
    cut = first[0].tolist().index(stop) + 1
    assert again[0].tolist() == first[0][:cut].tolist()
    assert torch.equal(again[1][:len(again[1])], first[1][:len(again[1])])


def test_compiled_round_equals_eager_round():
    """torch.compile(fullgraph=True) of the whole round (drafter, tree, mask, target forward on
    the static cache, verification, compaction, context): no graph break (fullgraph raises on
    one), and the same tokens as the eager round. A small vocabulary makes random trees
    accepted often (a vocabulary of 8 here), so compaction runs under the compiler too."""
    target = tiny_target(vocab=8, hidden=32, layers=2)
    drafter = tiny_drafter(target)
    prompts = _prompts(8)
    rnd = StaticRound(target, drafter, max_length=64, batch_size=2, budget=6, width=4, K=4)
    eager, eager_stats = rnd.generate(prompts, 20)
    compiled, compiled_stats = rnd.generate(prompts, 20, compile=True)
    for e, c, p in zip(eager, compiled, prompts):
        assert torch.equal(e, c)
        assert torch.equal(e, greedy_reference(target, p, 20))
    eager_requests, compiled_requests = eager_stats.pop("stats").requests, compiled_stats.pop("stats").requests
    assert eager_stats == compiled_stats and eager_requests == compiled_requests  # (the times differ)
    assert eager_stats["tau"] > 1.2, eager_stats  # paths were accepted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_round_on_cuda_equals_eager(mode):
    """On a GPU the compiled round (and, with "reduce-overhead", its CUDA graph) gives the eager
    round's tokens."""
    target = tiny_target(vocab=8, hidden=32, layers=2).cuda()
    drafter = tiny_drafter(target).cuda()
    prompts = [p.cuda() for p in _prompts(8)]
    rnd = StaticRound(target, drafter, max_length=64, batch_size=2, budget=6, width=4, K=4)
    eager, _ = rnd.generate(prompts, 20)
    compiled, _ = rnd.generate(prompts, 20, compile=True, mode=mode)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_sample_tokens_samples_the_tempered_softmax():
    draws, temperature = 40_000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -30.0])
    gen = torch.Generator().manual_seed(0)
    picks = sample_tokens(logits.expand(draws, -1), torch.rand(draws, generator=gen), torch.tensor(temperature))
    freq = torch.bincount(picks, minlength=logits.numel()).double() / draws
    probs = torch.softmax(logits.double() / temperature, -1)
    for f, p in zip(freq.tolist(), probs.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (freq, probs)
    assert torch.equal(sample_tokens(logits[None]), torch.tensor([0]))  # no uniform: the argmax
    edge = sample_tokens(logits[None], torch.tensor([0.99999994]), torch.tensor(1.0))
    assert 0 <= int(edge) < logits.numel()


def test_static_round_samples_the_target_at_t1():
    """T > 0: the first token a round emits is a sample of the target's softmax(logits / T) at
    the prompt, whatever the drafter drafted (verification against the target's sample)."""
    target = tiny_target(vocab=8, hidden=16, layers=1)
    prompt = torch.tensor([3, 5, 1])
    with torch.no_grad():
        probs = torch.softmax(target(prompt[None]).logits[0, -1].double() / 1.5, -1)
    rnd = StaticRound(target, tiny_drafter(target), max_length=16, batch_size=1, budget=4, width=2, K=2)
    gen = torch.Generator().manual_seed(1)
    draws = 600
    counts = torch.zeros(8, dtype=torch.float64)
    for _ in range(draws):
        out, _ = rnd.generate([prompt], 1, temperature=1.5, generator=gen)
        counts[out[0][0]] += 1
    for f, p in zip((counts / draws).tolist(), probs.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (counts / draws, probs)


def test_static_round_bad_input():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match="BlockDrafter"):
        StaticRound(target, object(), max_length=32)
    with pytest.raises(ValueError, match="depth"):
        StaticRound(target, drafter, max_length=32, depth=drafter.config.block_size)
    with pytest.raises(ValueError, match="budget"):
        StaticRound(target, drafter, max_length=32, budget=0)
    with pytest.raises(ValueError, match="max_length"):
        StaticRound(target, drafter, max_length=8, budget=8)
    rnd = StaticRound(target, drafter, max_length=24, batch_size=2, budget=4)
    with pytest.raises(ValueError, match="2 prompts"):
        rnd.generate([torch.tensor([1, 2])], 4)
    with pytest.raises(ValueError, match="1-D"):
        rnd.generate([torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match="room"):
        rnd.generate([torch.arange(1, 22), torch.tensor([1, 2])], 4)
    with pytest.raises(RuntimeError, match="cache is full"):
        rnd.generate([torch.arange(1, 9), torch.tensor([1, 2])], 40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rnd.generate([torch.tensor([1]), torch.tensor([2])], 0)
    with pytest.raises(ValueError, match="temperature"):
        rnd.generate([torch.tensor([1]), torch.tensor([2])], 2, temperature=-1.0)
