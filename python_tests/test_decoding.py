"""The generation loop: lossless at T = 0 (equal to HF greedy generate, token for token) and at
T > 0 (the distribution of generated sequences is the target's), for every method, B = 1 and
B > 1 with prompts of different lengths; stop tokens, stats and bad input."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext.decoding import HOOK_PHASES, METHODS, PhaseHook, SpeculativeDecoder  # noqa: E402
from dartree_ext.decoding.sampled import DraftQ as _DraftQ, children_and_q, sampled_chain  # noqa: E402
from dartree_ext.tree import Tree  # noqa: E402

from dartree_ext.models import LookupDrafter as OracleDrafter  # noqa: E402
from models import greedy_reference, tiny_drafter, tiny_target  # noqa: E402

NEW = 24


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():] = p
        mask[b, width - p.numel():] = 1
    return ids, mask


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 11, 1)]
    refs = [greedy_reference(target, p, NEW) for p in prompts]
    return target, tiny_drafter(target), prompts, refs


def check_greedy(decoder, prompts, refs, new=NEW):
    ids, mask = left_pad(prompts)
    out = decoder.generate(ids, mask, max_new_tokens=new)
    width = ids.shape[1]
    for b, ref in enumerate(refs):
        got = out.sequences[b, width:width + new]
        assert got.tolist() == ref[:new].tolist(), f"request {b} differs from greedy generate"
    assert torch.equal(out.sequences[:, :width], ids)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_generate_random_drafter(setup, method):
    target, drafter, prompts, refs = setup
    dec = SpeculativeDecoder(target, drafter, method, budget=16, width=4, K=8)
    check_greedy(dec, prompts[:1], refs[:1])   # B = 1
    out = check_greedy(dec, prompts, refs)      # B = 3, different lengths
    assert all(r.new_tokens == NEW for r in out.stats.requests)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "lookup")])
def test_greedy_equals_generate_long_accepted_paths(setup, method):
    """An oracle drafter gets long accepted paths, so compaction moves many entries per round."""
    target, drafter, prompts, refs = setup
    oracle = OracleDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    dec = SpeculativeDecoder(target, oracle, method, budget=24, width=4, K=8)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.tau > 2.0, f"{method}: tau {out.stats.tau} (the oracle should be accepted)"
    if method in ("ddtree", "dartree", "dartree_fixed", "seq_heap"):
        chain = check_greedy(SpeculativeDecoder(target, OracleDrafter(
            drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25), "chain", budget=64), prompts, refs)
        assert out.stats.tau > chain.stats.tau, "a tree should catch second-best tokens a chain misses"


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_other_architectures(kind, seed):
    target = tiny_target(kind, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (4, 9)]
    refs = [greedy_reference(target, p, 16) for p in prompts]
    oracle = OracleDrafter(tiny_drafter(target, seed=seed), [torch.cat([p, r]) for p, r in zip(prompts, refs)])
    check_greedy(SpeculativeDecoder(target, oracle, "dartree", budget=16, width=4, K=8), prompts, refs, 16)


def test_stop_token_inside_accepted_path(setup):
    target, drafter, prompts, refs = setup
    ref = refs[1]
    stop = int(ref[7])
    first = ref.tolist().index(stop)
    oracle = OracleDrafter(drafter, [torch.cat([prompts[1], ref])], miss=0.0)
    dec = SpeculativeDecoder(target, oracle, "dartree", budget=16, width=4, K=8)
    out = dec.generate(prompts[1][None], max_new_tokens=NEW, stop_token_ids=[stop])
    gen = out.sequences[0, prompts[1].numel():]
    assert gen.tolist() == ref[:first + 1].tolist()
    rs = out.stats.requests[0]
    assert rs.finish_reason == "stop" and rs.new_tokens == first + 1
    assert max(rs.accepted) > first - 1 or rs.rounds < first + 1  # it came inside a multi-token round


def test_finished_requests_stop_costing_work(setup):
    target, drafter, prompts, refs = setup
    dec = SpeculativeDecoder(target, drafter, "ar")
    ids, mask = left_pad(prompts[:2])
    calls = []
    hook = target.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["input_ids"].shape[0]),
                                            with_kwargs=True)
    try:
        # request 0 stops at its first generated token; request 1 runs to the end
        out = dec.generate(ids, mask, max_new_tokens=6, stop_token_ids=[int(refs[0][0])])
    finally:
        hook.remove()
    assert int(refs[0][0]) not in refs[1][:6].tolist(), "pick other prompts: the stop token appears in both"
    assert calls[1] == 2 and all(c == 1 for c in calls[2:])
    assert out.sequences[0, ids.shape[1] + 1:].tolist() == [0] * 5


def test_stats(setup):
    target, drafter, prompts, refs = setup
    oracle = OracleDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)])
    out = check_greedy(SpeculativeDecoder(target, oracle, "dartree", budget=16, width=4, K=8), prompts, refs)
    st = out.stats
    hist = st.accept_histogram()
    assert sum(hist) == st.rounds
    assert sum(a * c for a, c in enumerate(hist)) + st.rounds == pytest.approx(st.tau * st.rounds)
    assert all(n <= 16 for n in st.tree_nodes) and len(st.tree_nodes) == st.rounds
    assert set(st.time) == {"prefill", "draft", "tree", "verify", "bookkeeping"}
    summary = st.summary()
    assert summary["new_tokens"] == 3 * NEW and summary["tau"] >= 1.0
    assert sum(st.nodes_per_depth.values()) == sum(st.tree_nodes)


# T > 0 ---------------------------------------------------------------------------------------

def chi2_test(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic with the cells expecting fewer than 5 counts pooled into one, and
    its rejection threshold at z = 3.5 (false alarms about 2e-4)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_quantile(int(keep.sum()) - 1, 3.5)


def sampling_target(vocab: int = 4):
    """The tiny target of the distribution tests: next-token probabilities from about 0.05 to 0.55."""
    target = tiny_target("llama", vocab=vocab, hidden=16, layers=2, seed=3)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    return target


def exact_counts(target, prompt: torch.Tensor, new: int, copies: int, temperature: float,
                 top_p: float | None) -> torch.Tensor:
    """Expected counts of every sequence of ``new`` tokens after ``prompt`` over ``copies``
    samples (index: the tokens read as a base-V number), from the target's exact probabilities."""
    from dartree_ext.sampling import _filter_top_p
    vocab = target.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * new)
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = target(full).logits[:, prompt.numel() - 1:-1].float() / temperature
    if top_p is not None:
        logits = _filter_top_p(logits, top_p)
    logp = torch.log_softmax(logits, -1).gather(-1, seqs[..., None])[..., 0].sum(-1)
    return logp.exp() * copies


def assert_matches_target(generated: torch.Tensor, expected: torch.Tensor, vocab: int) -> None:
    """The generated sequences' frequencies pass the chi-square test against ``expected``
    (:func:`exact_counts`), and none falls outside its support."""
    new = generated.shape[1]
    index = (generated * torch.tensor([vocab ** (new - 1 - k) for k in range(new)])).sum(1)
    observed = torch.bincount(index, minlength=vocab ** new).double()
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a sequence top-p excludes"
    stat, limit = chi2_test(observed[support], expected[support])
    assert stat < limit, f"chi2 = {stat:.1f}, limit {limit:.1f}"


def chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal z."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def peaked_by_depth(drafter):
    """``drafter`` with 3 added to draft token ``d mod V`` 's base logit at each drafted depth ``d``
    (``V``: the width of its base logits, a draft vocabulary's where it has one): its
    distributions differ from depth to depth and are peaked (a random tiny drafter's are nearly
    alike at every depth, so a mix-up of depths or temperatures would go unseen)."""
    forward = drafter.forward

    def peaked(*args, **kwargs):
        out = forward(*args, **kwargs)
        depth, width = torch.arange(out.base_logits.shape[1]), out.base_logits.shape[-1]  # (a draft vocabulary's width)
        out.base_logits = out.base_logits + 3.0 * torch.nn.functional.one_hot(depth % width, width).to(out.base_logits)
        return out

    drafter.forward = peaked
    return drafter


def sample_and_check(method, temperature, top_p, budget, seed, curve=None, peaked=False, draft_vocab=None, **kwargs):
    """Generate 3 tokens for 3000 copies of one prompt with a 4-token vocabulary, check the 64
    sequence frequencies against the target's exact probabilities (:func:`assert_matches_target`)
    and return the decode's output. Deterministic (fixed generator). ``draft_vocab``: the
    drafter's reduced vocabulary (target ids)."""
    vocab, new, copies = 4, 3, 3000
    target = sampling_target(vocab)
    drafter = tiny_drafter(target, seed=4, block_size=4)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    if peaked:
        drafter = peaked_by_depth(drafter)
    prompt = torch.tensor([1, 2, 3, 0, 2])
    expected = exact_counts(target, prompt, new, copies, temperature, top_p)
    if budget == "auto":  # nodes nearly free (or ``curve``): per-round trees from the calibrated scores, batch 3000
        from dartree_ext.decoding.cost import CostModel
        kwargs.update(cost_model=CostModel.from_curve(curve or {0: 10.0, 10 ** 6: 11.0}), max_budget=16)
    dec = SpeculativeDecoder(target, drafter, method, budget=budget, **kwargs)
    out = dec.generate(prompt.expand(copies, -1).contiguous(), max_new_tokens=new, temperature=temperature,
                       top_p=top_p, generator=torch.Generator().manual_seed(seed))
    assert_matches_target(out.sequences[:, prompt.numel():], expected, vocab)
    return out


@pytest.mark.parametrize("method,temperature,top_p,budget", [("dartree", 1.0, None, 16), ("ddtree", 0.7, 0.9, 16),
                                                             ("chain", 1.0, None, 16), ("dartree", 1.0, None, "auto"),
                                                             ("chain", 0.7, 0.9, "auto"), ("lookup", 1.0, None, 16),
                                                             ("lookup", 0.7, 0.9, "auto")])
def test_sampling_distribution_matches_target(method, temperature, top_p, budget):
    """:func:`sample_and_check` for each method."""
    out = sample_and_check(method, temperature, top_p, budget, 11, width=4, K=4)
    if method != "chain":  # the context continuation (lookup) is right less often than a tree
        assert out.stats.tau > (1.1 if method == "lookup" else 1.2), \
            "the draft trees should be accepted at times, or the test proves little"


@pytest.mark.parametrize("method,top_p,budget", [("dartree", None, "auto"), ("lookup", 0.9, 16)])
def test_sampling_distribution_with_a_corpus(method, top_p, budget):
    """A corpus continuation (:class:`CorpusIndex`) grafted at T > 0 leaves the output distributed
    as the target's."""
    from dartree_ext.decoding.lookup import CorpusIndex
    gen = torch.Generator().manual_seed(5)
    corpus = CorpusIndex([torch.randint(0, 4, (30,), generator=gen).tolist() for _ in range(4)] + [[3, 0, 2, 1, 1, 2]])
    out = sample_and_check(method, 1.0, top_p, budget, 13, width=4, K=4, lookup=3, corpus=corpus, corpus_sampling=True)
    assert out.stats.corpus_rounds > 0 and out.stats.corpus_accepted > 0


@pytest.mark.parametrize("temperature,top_p,budget", [(1.0, None, 16), (0.7, 0.9, "auto"), (1.0, None, "auto")])
def test_sampled_draft_distribution_matches_target(temperature, top_p, budget):
    """``chain`` with ``sampled_draft``: each depth's token drawn from the drafter and accepted by
    speculative sampling; the sequences' frequencies match the target's exact probabilities as in
    :func:`test_sampling_distribution_matches_target` (one cut for the batch under ``budget="auto"``:
    the next test checks the cut never looks at the drawn tokens)."""
    out = sample_and_check("chain", temperature, top_p, budget, 12, peaked=True, sampled_draft=True)
    assert out.stats.tau > 1.2, "the sampled chains should be accepted at times, or the test proves little"


@pytest.mark.parametrize("budget", [16, "auto"])
def test_sampled_draft_with_a_draft_vocabulary_matches_target(budget):
    """``sampled_draft`` with a reduced draft vocabulary (target ids 2, 0, 3; token 1 is never
    drafted, so q(1) = 0 and the residual keeps p(1)): each depth's distribution is drawn over the
    draft vocabulary and spread over the target's at its ids; the frequencies match the target's."""
    curve = {0: 10.0, 6000: 10.5, 9000: 20.0, 12000: 40.0}  # auto, batch 3000: steep past a node, so chains are cut
    out = sample_and_check("chain", 1.0, None, budget, 13, curve=curve, peaked=True, draft_vocab=[2, 0, 3],
                           sampled_draft=True)
    assert out.stats.tau > 1.2, "the sampled chains should be accepted at times, or the test proves little"
    if budget == "auto":
        assert statistics.mean(out.stats.tree_nodes) < 2, "the chains (3 nodes) should be cut, or this repeats budget=16"


def test_sampled_draft_one_request_at_a_time_matches_target():
    """Batch 1, so each request's own chain could decide its cut under ``budget="auto"`` (a steep
    cost curve, where the cut is near the margin): 1500 decodes of 2 tokens pass the chi-square
    test. A cut that looked at the drawn tokens (scores from their own log q) fails it here at
    chi2 116 against a limit of 42; the cut from the top-1 chain's scores is the same whatever
    was drawn."""
    from dartree_ext.decoding.cost import CostModel
    vocab, new, copies = 4, 2, 1500
    target = sampling_target(vocab)
    drafter = tiny_drafter(target, seed=4, block_size=4)
    prompt = torch.tensor([1, 2, 3, 0, 2])
    dec = SpeculativeDecoder(target, drafter, "chain", budget="auto", sampled_draft=True, lookup=0, max_budget=16,
                             cost_model=CostModel.from_curve({0: 10.0, 1: 10.1, 2: 10.4, 3: 13.0}))
    gen = torch.Generator().manual_seed(5)
    seqs = [dec.generate(prompt[None], max_new_tokens=new, temperature=1.0, generator=gen).sequences[0, prompt.numel():]
            for _ in range(copies)]
    assert_matches_target(torch.stack(seqs), exact_counts(target, prompt, new, copies, 1.0, None), vocab)


def test_children_and_q_follow_a_cut_chain():
    """Each node's one child token and the distribution it was drawn from (its depth's row), in a
    chain cut by ``prune``, a row cut shorter (early exit: depth -1 past the cut), and a root-only
    row; padding and leaves have no child (-1)."""
    q = torch.softmax(torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0)), -1)
    tokens = torch.tensor([[9, 1, 2, 3, 4], [8, 5, 0, 0, 0], [7, 0, 0, 0, 0]])
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]], dtype=torch.int32)
    depths = torch.tensor([[0, 1, 2, 3, 4], [0, 1, -1, -1, -1], [0, 1, 2, 3, 4]], dtype=torch.int32)
    tree = Tree(tokens=tokens, parents=parents, depths=depths, scores=torch.zeros(3, 5),
                num_nodes=torch.tensor([4, 2, 1], dtype=torch.int32))
    child, rows = children_and_q(tree, _DraftQ(q), 6)
    assert child.tolist() == [[1, 2, 3, -1, -1], [5, -1, -1, -1, -1], [-1, -1, -1, -1, -1]]
    for b, d in [(0, 0), (0, 1), (0, 2), (1, 0)]:  # node d's child sits at depth d + 1: q row d
        assert torch.equal(rows[b, d], q[b, d])
    # a draft vocabulary: each row spread over the target's 10 tokens at its target ids, 0 elsewhere
    vocab = torch.tensor([9, 1, 2, 3, 4, 5])
    _, spread = children_and_q(tree, _DraftQ(q, vocab), 10)
    assert spread.shape == (3, 5, 10)
    for b, d in [(0, 0), (0, 2), (1, 0)]:
        assert torch.equal(spread[b, d, vocab], q[b, d])
        assert spread[b, d, [0, 6, 7, 8]].abs().sum() == 0


def test_sampled_draft_cut_does_not_look_at_the_drawn_tokens(setup):
    """``budget="auto"`` cuts a sampled chain by its scores; the scores (and so the cut) must be the
    same whatever tokens were drawn, or the cut would bias the output (verifying a drawn token only
    when it is a likely one: with p = (0.5, 0.5), q = (0.9, 0.1) and the chain cut when it drew the
    second token, the first token is emitted with probability 0.55). Two draws from one drafter
    pass give different tokens and the same scores and cut."""
    from dartree_ext.decoding.cost import CostModel
    target, drafter, prompts, _ = setup
    dec = SpeculativeDecoder(target, drafter, "chain", budget="auto", sampled_draft=True,
                             cost_model=CostModel.from_curve({0: 10.0, 4: 10.2, 8: 12.0, 15: 30.0}))
    base_logits = 4 * torch.randn(4, 15, 97, generator=torch.Generator().manual_seed(3))
    root = torch.tensor([1, 2, 3, 4])
    trees = [sampled_chain(base_logits, root, None, {"temperature": 1.0, "generator": torch.Generator().manual_seed(s)})[0]
             for s in (0, 1)]
    assert not torch.equal(trees[0].tokens, trees[1].tokens)
    assert torch.equal(trees[0].scores, trees[1].scores)
    assert torch.equal(trees[0].scores, dec.build_tree(None, base_logits, root).scores)  # the top-1 chain's
    cuts = [dec.choose_tree(t, 16)[1] for t in trees]
    assert cuts[0] == cuts[1] and 0 < cuts[0] < 15


def test_sampled_draft_is_greedy_chain_at_t0_and_only_for_chain(setup):
    target, drafter, prompts, _ = setup
    ids = prompts[0][None]
    ar = SpeculativeDecoder(target, None, "ar").generate(ids, max_new_tokens=12)
    out = SpeculativeDecoder(target, drafter, "chain", budget=8, sampled_draft=True).generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, ar.sequences)
    with pytest.raises(ValueError, match="sampled_draft"):
        SpeculativeDecoder(target, drafter, "dartree", sampled_draft=True)


def test_sampling_test_detects_a_biased_sampler():
    """The chi-square check above can fail: a sampler at the wrong temperature fails it."""
    vocab, copies = 4, 3000
    target = sampling_target(vocab)
    prompt = torch.tensor([1, 2, 3, 0, 2])
    with torch.no_grad():
        p = torch.softmax(target(prompt[None]).logits[0, -1].float(), -1)
    out = SpeculativeDecoder(target, None, "ar").generate(prompt.expand(copies, -1).contiguous(), max_new_tokens=1,
                                                          temperature=0.6, generator=torch.Generator().manual_seed(1))
    observed = torch.bincount(out.sequences[:, -1], minlength=vocab).double()
    stat, limit = chi2_test(observed, p * copies)
    assert stat > limit


# bad input -----------------------------------------------------------------------------------

def test_bad_input(setup):
    target, drafter, prompts, _ = setup
    dec = SpeculativeDecoder(target, drafter, "dartree")
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(prompts[0][None], max_new_tokens=0)
    with pytest.raises(ValueError, match="context"):
        dec.generate(torch.zeros(1, 600, dtype=torch.int64), max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown method"):
        SpeculativeDecoder(target, drafter, "beam")
    with pytest.raises(ValueError, match="budget"):
        SpeculativeDecoder(target, drafter, "dartree", budget=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(target, None, "dartree")
    other = tiny_target("llama", vocab=101)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeDecoder(other, tiny_drafter(target), "dartree")
    with pytest.raises(ValueError, match="token ids"):
        dec.generate(torch.tensor([[5, 200]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        dec.generate(torch.tensor([[5, 6]]), torch.tensor([[0, 0]]), max_new_tokens=2)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_greedy_several_seeds(seed):
    """Other targets, drafters and prompts (B = 2), every tree method against HF greedy."""
    target = tiny_target("llama", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (int(n),), generator=gen) for n in torch.randint(1, 12, (2,), generator=gen)]
    refs = [greedy_reference(target, p, 16) for p in prompts]
    drafter = OracleDrafter(tiny_drafter(target, seed=seed), [torch.cat([p, r]) for p, r in zip(prompts, refs)],
                            miss=0.5, seed=seed)
    for method in ("chain_corrected", "ddtree", "dartree", "dartree_fixed"):
        check_greedy(SpeculativeDecoder(target, drafter, method, budget=12, width=3, K=6), prompts, refs, 16)


def test_per_depth_widths_decode_losslessly():
    target = tiny_target()
    drafter = tiny_drafter(target)
    prompt = torch.randint(1, 97, (6,), generator=torch.Generator().manual_seed(4))
    ref = greedy_reference(target, prompt, 10)
    out = SpeculativeDecoder(target, drafter, "dartree", budget=12, width=(6, 2)).generate(prompt[None],
                                                                                         max_new_tokens=10)
    assert torch.equal(out.sequences[0, prompt.numel():], ref)
    with pytest.raises(ValueError, match="widths must be >= 1"):
        SpeculativeDecoder(target, drafter, "dartree", width=(4, 0))
    assert SpeculativeDecoder(target, drafter, "dartree", width=np.int64(6)).width == 6  # any integer type


# the verification head at inference: early exit and the "vh" estimator ---------------------------

def _with_vh_bias(drafter, prob: float):
    """``drafter`` with its verification head predicting ``prob`` at every position."""
    import copy
    d = copy.deepcopy(drafter)
    with torch.no_grad():
        d.verification_head.proj.weight.zero_()
        d.verification_head.proj.bias.fill_(math.log(prob / (1 - prob)))
    return d


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "lookup")])
def test_early_exit_lossless(setup, method):
    """Early exit at the head's predicted first rejection keeps every method exact (the random
    heads' probabilities straddle the thresholds, so the cut lands at varied depths)."""
    target, drafter, prompts, refs = setup
    oracle = OracleDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    check_greedy(SpeculativeDecoder(target, oracle, method, budget=16, width=4, K=8, early_exit=0.45), prompts, refs)
    out = check_greedy(SpeculativeDecoder(target, drafter, method, budget=16, width=4, K=8, early_exit=0.5),
                       prompts, refs)
    if method in ("chain", "chain_corrected"):
        assert len(set(out.stats.tree_nodes)) > 1, "the cut should vary from round to round"


def test_early_exit_cuts_where_the_head_says(setup):
    """A head at 0.7 everywhere keeps the whole chain at p = 0.6 and none of it at p = 0.8 (every
    round a plain step, output still exact)."""
    target, drafter, prompts, refs = setup
    sure = _with_vh_bias(drafter, 0.7)
    full = check_greedy(SpeculativeDecoder(target, sure, "chain", budget=64, early_exit=0.6), prompts, refs)
    depth = drafter.config.block_size - 1
    assert set(full.stats.tree_nodes) == {depth}
    none = check_greedy(SpeculativeDecoder(target, sure, "chain", budget=64, early_exit=0.8), prompts, refs)
    assert set(none.stats.tree_nodes) == {0} and none.stats.tau == 1.0


def test_early_exit_cuts_each_chain_row_on_its_own(setup):
    """Chains are cut per row, at each row's first position below the threshold."""
    from dartree_ext.decoding.phases import leading_at_least, propose
    prob = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.4], [0.6, 0.3, 0.9, 0.9, 0.9], [0.1, 0.9, 0.9, 0.9, 0.9]])
    assert leading_at_least(prob, 0.5).tolist() == [4, 1, 0]
    target, drafter, prompts, refs = setup

    dec = SpeculativeDecoder(target, _with_vh_bias(drafter, 0.7), "chain", budget=64, early_exit=0.6)
    from dartree_ext.models.drafter import DraftOutput
    from dartree_ext.decoding.state import Batch as _Batch, Session as _Run
    rows, depth = 3, 5
    draft = DraftOutput(hidden=torch.zeros(rows, depth, 4), base_logits=torch.randn(rows, depth, 97),
                        accept_prob=torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.4], [0.7, 0.3, 0.9, 0.9, 0.9],
                                                  [0.9, 0.9, 0.9, 0.9, 0.9]]))
    run = _Run(dec, [torch.tensor([1])] * rows, 8, set(), {})
    state = _Batch(active=torch.arange(rows), pad=torch.zeros(rows, dtype=torch.int64),
                   length=torch.zeros(rows, dtype=torch.int64), root=torch.tensor([1, 2, 3]), cache=None)
    tree, chosen = propose(dec, run, state, draft)
    assert tree.num_nodes.tolist() == [1 + 4, 1 + 1, 1 + 5] and chosen is None
    assert (tree.depths[1, 2:] == -1).all() and tree.depths[2].tolist() == [0, 1, 2, 3, 4, 5]


def test_vh_estimator_expected_accepted_by_hand(setup):
    """E[n] with the head's probabilities on a hand-built tree: root, two depth-1 nodes (path
    log-probs -0.1, -1.0), one depth-2 child of the first (-0.3)."""
    from dartree_ext.tree import Tree
    target, drafter, _, _ = setup
    from dartree_ext.decoding.cost import CostModel
    dec = SpeculativeDecoder(target, drafter, "ddtree", budget="auto", cost_model=CostModel.from_curve({0: 1.0, 64: 2.0}))
    tree = Tree(tokens=torch.tensor([[5, 6, 7, 8]]), parents=torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32),
                depths=torch.tensor([[0, 1, 1, 2]], dtype=torch.int32), scores=torch.tensor([[0.0, -0.1, -1.0, -0.3]]),
                num_nodes=torch.tensor([4], dtype=torch.int32))
    prob = torch.tensor([[0.8, 0.5]])
    e = dec.expected_accepted(tree, prob)
    p1, p2, p3 = 0.8, 0.5, 0.8 * math.exp(-0.9)   # best-first: -0.1, -0.3 (depth 2), -1.0
    assert torch.allclose(e, torch.tensor([0.0, p1, p1 + p2, p1 + p2 + p3]), atol=1e-6)


@pytest.mark.parametrize("estimator", ["score", "adaptive"])
def test_score_estimator_expected_accepted_by_hand(setup, estimator):
    """E[n] from calibrated scores on a hand-built batch of two: each row's nodes best first
    (ties in node order), padding and the root left out, the rows' sums added; the adaptive
    level scales node d's probability by factor**d (capped)."""
    from dartree_ext.decoding.calibration import AcceptanceCalibrator, AcceptanceLevel, DepthCalibrator
    from dartree_ext.decoding.cost import CostModel
    from dartree_ext.tree import Tree
    target, drafter, _, _ = setup
    dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", estimator=estimator,
                             cost_model=CostModel.from_curve({0: 1.0, 64: 2.0}))
    dec.calibrator, dec.sizing.level = DepthCalibrator([AcceptanceCalibrator()]), AcceptanceLevel()  # every depth alike
    dec.sizing.level.factor = 0.5
    tree = Tree(tokens=torch.tensor([[5, 6, 7, 8], [5, 1, 2, 0]]),
                parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]], dtype=torch.int32),
                depths=torch.tensor([[0, 1, 1, 2], [0, 1, 2, -1]], dtype=torch.int32),
                scores=torch.tensor([[0.0, -0.6, -0.3, -0.6], [0.0, -2.2, -4.5, -0.01]]),
                num_nodes=torch.tensor([4, 3], dtype=torch.int32))
    p = dec.calibrator.classes[0].predict(torch.tensor([-0.3, -0.6, -0.6, -2.2, -4.5])).tolist()
    if estimator == "adaptive":
        p = [v * 0.5 ** d for v, d in zip(p, [1, 1, 2, 1, 2])]
    row0, row1 = [p[0], p[1], p[2]], [p[3], p[4], 0.0]         # -0.3 first, then -0.6 (node 1), -0.6 (node 3)
    want = [0.0] + [sum(row0[:n]) + sum(row1[:n]) for n in (1, 2, 3)]
    assert torch.allclose(dec.expected_accepted(tree), torch.tensor(want), atol=1e-6)


@pytest.mark.parametrize("estimator", ["score", "adaptive"])
def test_score_estimator_expected_accepted_random_trees(setup, estimator):
    """E[n] from calibrated scores (plain Python per round) against the same sums in NumPy on
    random batches: padding past each row's nodes, grafted nodes without a score (-inf), tied
    scores, a calibration with counts, and the adaptive level's factor."""
    from dartree_ext.decoding.calibration import AcceptanceLevel, DepthCalibrator
    from dartree_ext.decoding.cost import CostModel
    from dartree_ext.tree import Tree
    target, drafter, _, _ = setup
    dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", estimator=estimator,
                             cost_model=CostModel.from_curve({0: 1.0, 64: 2.0}))
    gen = np.random.default_rng(1)
    dec.calibrator, dec.sizing.level = DepthCalibrator.fresh(3), AcceptanceLevel()
    dec.calibrator.update(-gen.exponential(1.0, 300).astype(np.float32), gen.random(300) < 0.5,
                          gen.integers(1, 5, 300))
    dec.sizing.level.factor = 0.7
    for _ in range(10):
        rows, width = int(gen.integers(1, 4)), int(gen.integers(2, 12))
        scores = np.round(-gen.exponential(1.0, (rows, width)), 1).astype(np.float32)   # (ties)
        scores[:, 0] = 0.0
        scores[gen.random((rows, width)) < 0.15] = -np.inf
        depths = gen.integers(1, 6, (rows, width)).astype(np.int32)
        depths[:, 0] = 0
        num = gen.integers(1, width + 1, rows).astype(np.int32)
        tree = Tree(tokens=torch.zeros(rows, width, dtype=torch.int64), parents=torch.zeros(rows, width, dtype=torch.int32),
                    depths=torch.from_numpy(depths), scores=torch.from_numpy(scores), num_nodes=torch.from_numpy(num))
        scores[gen.random((rows, width)) < 0.05] = np.nan  # (ranked as -inf)
        scores[:, 0] = 0.0
        s, d = scores[:, 1:], depths[:, 1:]
        valid = np.arange(1, width)[None] < num[:, None]
        s = np.where(valid & ~np.isnan(s), s, -np.inf).astype(np.float32)
        p = np.where(s > -np.inf, dec.calibrator.predict_np(s, d), 0.0)
        if estimator == "adaptive":
            p = np.minimum(p * 0.7 ** np.maximum(d, 0), dec.sizing.level.p_max)
        order = np.argsort(-s, axis=1, kind="stable")
        want = np.concatenate([[0.0], np.take_along_axis(p, order, 1).cumsum(1).sum(0)])
        np.testing.assert_allclose(dec.expected_accepted(tree).numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["vh", "adaptive"])
@pytest.mark.parametrize("method", ["chain", "dartree"])
def test_estimators_lossless(setup, method, estimator):
    target, drafter, prompts, refs = setup
    from dartree_ext.decoding.cost import CostModel
    cost = CostModel.from_curve({0: 10.0, 64: 12.0})
    oracle = OracleDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    dec = SpeculativeDecoder(target, oracle, method, budget="auto", width=4, K=8, max_budget=24, cost_model=cost,
                             estimator=estimator)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.rounds > 0
    if estimator == "adaptive":  # the call's level learned from its rounds (the oracle misses a quarter)
        assert dec.sizing.level.factor != 1.0


def test_vh_bad_input(setup):
    target, drafter, _, _ = setup
    with pytest.raises(ValueError, match="early_exit"):
        SpeculativeDecoder(target, drafter, "chain", early_exit=1.5)
    with pytest.raises(ValueError, match="early_exit"):
        SpeculativeDecoder(target, drafter, "chain", early_exit=0.0)
    with pytest.raises(ValueError, match="estimator"):
        SpeculativeDecoder(target, drafter, "chain", budget="auto", estimator="oracle")


def test_auto_budget_records_each_chosen_tree_once(setup):
    """budget="auto" keeps the depths of the trees it verified, one entry per round (the draft
    depth of later rounds is read off them)."""
    from dartree_ext.decoding.cost import CostModel
    target, drafter, prompts, refs = setup
    oracle = OracleDrafter(drafter, [torch.cat([p, r]) for p, r in zip(prompts, refs)], miss=0.25)
    dec = SpeculativeDecoder(target, oracle, "ddtree", budget="auto", K=8, max_budget=16,
                             cost_model=CostModel.from_curve({0: 10.0, 64: 10.5}))
    out = check_greedy(dec, prompts[:1], refs[:1], new=8)
    chosen = sum(1 for n in out.stats.tree_nodes if n > 0)
    assert chosen > 0 and len(dec.sizing.recent_depths) == min(chosen, 16)


def test_context_kv_kept_per_slot_equals_recomputing(setup):
    """The decoder keeps the drafter's keys/values of its context per slot (computed once, when a
    slot is committed) instead of projecting the whole context every round: every round's draft
    is the same as with the context projected again, at B = 3 with different prompt lengths."""
    target, drafter, prompts, refs = setup
    ids, mask = left_pad(prompts)
    drafts = {}
    for keep in (True, False):
        dec = SpeculativeDecoder(target, drafter, "dartree", budget=16, width=4, K=8)
        dec.keep_context_kv = keep
        seen = []

        class Record(PhaseHook):
            def exit(self, phase, state, draft, _seen=seen):
                if phase == "draft":
                    _seen.append((state.context_kv is not None, draft.base_logits.clone()))
        out = dec.generate(ids, mask, max_new_tokens=NEW, hook=Record())
        drafts[keep] = (seen, out.sequences)
    (kept, seq_kept), (recomputed, seq_recomputed) = drafts[True], drafts[False]
    assert all(used for used, _ in kept) and not any(used for used, _ in recomputed)
    assert len(kept) == len(recomputed) > 3
    for (_, a), (_, b) in zip(kept, recomputed):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(seq_kept, seq_recomputed)


def test_context_queued_while_the_drafter_rests_equals_making_it_every_round(setup):
    """While the automatic budget rests the drafter (rounds planned as plain steps), the target's
    features of committed slots wait and are projected in one batch before the drafter's next
    pass. Every draft sees the context of every committed slot, equal to the drafter's projection
    of the target's features of the final sequences, and drafts the same as with the context made
    every round: B = 3, prompts of different lengths, rows finishing at different rounds (a stop
    token) while slots wait."""
    from dartree_ext.decoding.cost import CostModel
    target, drafter, prompts, refs = setup
    ids, mask = left_pad(prompts)
    stop = int(refs[0][1])  # request 0 stops in round 1, while the slots of round 0 wait
    runs = {}
    for defer in (True, False):
        # verifying any draft node costs 100x a plain step: every probe plans a plain round
        dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", width=4, K=8, max_budget=16,
                                 cost_model=CostModel.from_curve({0: 1.0, 1: 100.0, 64: 200.0}))
        dec.defer_context = defer
        seen, flushes = [], []

        class Record(PhaseHook):
            def enter(self, phase, state, _n=flushes):
                if phase == "context":  # the queued slots, about to be made in one batch
                    _n.append(len(state.pending))

            def exit(self, phase, state, draft, _seen=seen):
                if phase == "draft" and draft is not None:
                    _seen.append((draft.base_logits.clone(), state.active.clone(), state.past_valid.clone(),
                                  state.context[:, :state.cache_len].clone()))
        out = dec.generate(ids, mask, max_new_tokens=NEW, stop_token_ids=[stop], hook=Record())
        runs[defer] = seen, flushes, out
    (deferred, batched, out_d), (every, single, out_e) = runs[True], runs[False]
    assert torch.equal(out_d.sequences, out_e.sequences)
    assert len({len(r.accepted) for r in out_d.stats.requests}) > 1, "the rows should finish at different rounds"
    assert len(deferred) == len(every) > 2
    assert max(batched) > 1 and max(single) == 1, "rounds should wait while the drafter rests"
    seq = out_d.sequences
    real = torch.arange(seq.shape[1])[None] >= (ids.shape[1] - mask.sum(1))[:, None]  # past the left padding
    with torch.no_grad():
        full = target(input_ids=seq, attention_mask=real.long(), output_hidden_states=True)
        expected = drafter.project_context(drafter.target_features(full.hidden_states))
    for (logits_a, rows, live, ctx_a), (logits_b, _, _, ctx_b) in zip(deferred, every):
        torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=1e-5)
        for ctx in (ctx_a, ctx_b):
            torch.testing.assert_close(ctx[live], expected[rows][:, :live.shape[1]][live], atol=1e-4, rtol=1e-4)


def test_phase_hook_sees_every_phase_in_order_and_changes_nothing(setup):
    """A :class:`PhaseHook` is entered and exited around the prefill and, every round, the draft,
    tree, verify, commit and retire phases (the drafter's context and the lookup branch inside
    them); it sees each phase's result, and the output is the same as without it."""
    target, drafter, prompts, refs = setup
    ids, mask = left_pad(prompts)
    events, verdicts = [], []

    class Record(PhaseHook):
        def enter(self, phase, state):
            events.append(("enter", phase))

        def exit(self, phase, state, result):
            events.append(("exit", phase))
            if phase == "verify":
                verdicts.append(result)
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=16, width=4, K=8, lookup=4)
    plain = dec.generate(ids, mask, max_new_tokens=NEW)
    out = dec.generate(ids, mask, max_new_tokens=NEW, hook=Record())
    assert torch.equal(out.sequences, plain.sequences)
    assert events[:2] == [("enter", "prefill"), ("exit", "prefill")]
    top = [p for kind, p in events[2:] if kind == "enter" and p not in ("context", "lookup")]
    assert top == ["draft", "tree", "verify", "commit", "retire"] * max(r.rounds for r in out.stats.requests)
    assert {p for _, p in events} == set(HOOK_PHASES)
    assert sum(v.accepted[0] + 1 for v in verdicts if len(v.accepted)) > 0
    for kind, phase in events:  # balanced: every enter has its exit
        assert events.count(("enter", phase)) == events.count(("exit", phase))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_target_logits_stop_the_call_naming_the_request(setup, monkeypatch, temperature):
    """Target logits no token can be drawn from (a NaN) stop the call with an error naming the
    request, its round and the tree node, at T = 0 and T > 0: no token is made up."""
    target, drafter, prompts, _ = setup
    forward, calls = target.forward, []

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # prefill, round 1, then round 2's verification
            out.logits[1, 0, 5] = float("nan")
        return out

    monkeypatch.setattr(target, "forward", poisoned)
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=8, width=4, K=8)
    ids, mask = left_pad(prompts)
    with pytest.raises(ValueError, match=r"the target's logits for request 1 \(round 2, after \d+ new tokens\) at "
                                         r"tree node 0 holds a NaN"):
        dec.generate(ids, mask, max_new_tokens=NEW, temperature=temperature, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["chain", "ddtree", "dartree"])
def test_nan_draft_scores_make_a_plain_round(setup, monkeypatch, method):
    """A drafter whose scores hold a NaN: that round verifies no draft, with a warning, and the
    output is still plain decoding's."""
    import dataclasses
    target, drafter, prompts, refs = setup
    forward, calls = drafter.forward, []

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            out = dataclasses.replace(out, base_logits=out.base_logits.clone().fill_(float("nan")))
        return out

    monkeypatch.setattr(drafter, "forward", poisoned)
    knobs = {"chain": {}, "ddtree": {"K": 8}, "dartree": {"width": 4, "K": 8}}[method]
    dec = SpeculativeDecoder(target, drafter, method, budget=8, **knobs)
    with pytest.warns(RuntimeWarning, match="the drafter's scores hold a NaN: this round verifies no draft"):
        out = check_greedy(dec, prompts, refs)
    assert len(calls) > 2 and out.stats.rounds > 0
