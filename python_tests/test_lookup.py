"""Context lookup: the n-gram index, the acceptance statistics, grafting a continuation into a
draft tree, and decoding with it (lossless for every method, cut by cost under budget="auto")."""
from __future__ import annotations

import pytest
import torch

from dartree_ext.decoding import METHODS, SpeculativeDecoder
from dartree_ext.decoding.cost import CostModel
from dartree_ext.decoding.lookup import CORPUS_MAX_NGRAM, ContextIndex, CorpusIndex, LookupStats, graft_chains, suffix_array
from dartree_ext.loading import load_corpus
from dartree_ext.models import LookupDrafter as OracleDrafter
from dartree_ext.tree import Tree
from models import greedy_reference, tiny_drafter, tiny_target
from test_decoding import check_greedy, left_pad


def brute_propose(tokens, length, max_ngram=4):
    """The latest earlier occurrence of the longest suffix, by scanning."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + length], n
    return [], 0


def test_context_index_matches_a_scan():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        seq = torch.randint(0, 5, (60,), generator=gen).tolist()
        index = ContextIndex(seq[:3])
        pos = 3
        while pos < len(seq):  # tokens arrive in rounds of 1-4, as accepted paths do
            step = int(torch.randint(1, 5, (1,), generator=gen))
            index.extend(seq[pos:pos + step])
            pos += step
            got = index.propose(6)
            assert got == brute_propose(seq[:pos], 6), (trial, pos)


def test_context_index_by_hand():
    index = ContextIndex([5, 1, 2, 3, 9, 1, 2])
    assert index.propose(3) == ([3, 9, 1], 2)   # "1 2" occurred, followed by 3 9 1
    index.extend([7])
    assert index.propose(3) == ([], 0)          # 7 never occurred before
    index.extend([1])
    assert index.propose(2) == ([2, 7], 1)      # the latest "1" (position 5), not the first
    assert ContextIndex([4]).propose(5) == ([], 0)
    assert ContextIndex([4, 4]).propose(5) == ([4], 1)  # a repeat continues itself
    assert index.propose(0) == ([], 0)
    with pytest.raises(ValueError, match="max_ngram"):
        ContextIndex([1], max_ngram=0)


def test_lookup_stats_learn_conditional_acceptance():
    stats = LookupStats(max_depth=4, prior_weight=1.0)
    prior = stats.conditional(4)
    assert prior[0] == pytest.approx(LookupStats.PRIOR[3])
    for _ in range(99):  # 4-gram matches: the first 2 tokens always right, the third never
        stats.update(4, proposed=4, accepted=2)
    c = stats.conditional(4)
    assert c[0] == pytest.approx((99 + prior[0]) / 100) and c[1] == pytest.approx((99 + prior[1]) / 100)
    assert c[2] == pytest.approx(prior[2] / 100)
    assert c[3] == pytest.approx(prior[3])       # never tried: the prior
    assert stats.conditional(1) == LookupStats(max_depth=4, prior_weight=1.0).conditional(1)  # other n untouched
    p = stats.path_probs(4, 3)
    assert p == pytest.approx([c[0], c[0] * c[1], c[0] * c[1] * c[2]])
    assert stats.conditional(9) == stats.conditional(4)  # longer matches share the last bucket


def test_lookup_stats_keep_new_nodes_apart_from_agreeing_ones():
    """Tokens the drafter's tree already had and new nodes are learned in separate tables, and a
    path multiplies each depth's conditional from its own table."""
    from dartree_ext.decoding.lookup import new_nodes as _new_nodes
    assert _new_nodes([0, 1, 1, 2]) == [False, True, False, True] and _new_nodes([1, 2]) == [True, True]
    stats = LookupStats(max_depth=4, prior_weight=1.0)
    prior = stats.conditional(4)
    for _ in range(99):  # agreeing first tokens always right; the new second ones never
        stats.update(4, proposed=3, accepted=1, new=[False, True, True])
    agree, novel = stats.conditional(4, agree=True), stats.conditional(4)
    assert agree[0] == pytest.approx((99 + prior[0]) / 100) and agree[1] == pytest.approx(prior[1])
    assert novel[0] == pytest.approx(prior[0]) and novel[1] == pytest.approx(prior[1] / 100)
    assert novel[2] == pytest.approx(prior[2])  # never reached
    assert stats.path_probs(4, 2, [False, True]) == pytest.approx([agree[0], agree[0] * novel[1]])
    assert stats.path_probs(4, 2) == pytest.approx([novel[0], novel[0] * novel[1]])
    assert float(stats.trials.sum() + stats.agree_trials.sum()) == 2 * 99
    # per-regime priors: a sampled token matches a copied one less often than a greedy one
    greedy, sample = LookupStats().conditional(2), LookupStats(regime="sample").conditional(2)
    assert greedy[0] == LookupStats.PRIORS["greedy"][0][1] and sample[0] == LookupStats.PRIORS["sample"][0][1]
    assert sample[0] < greedy[0] and sample[1] < greedy[1]
    with pytest.raises(ValueError, match="regime"):
        LookupStats(regime="beam")


def small_tree() -> Tree:
    """Row 0: root -> 7 -> 8, root -> 9 (3 nodes); row 1: root alone, padded."""
    return Tree(tokens=torch.tensor([[1, 7, 9, 8], [2, 0, 0, 0]]),
                parents=torch.tensor([[-1, 0, 0, 1], [-1, -1, -1, -1]], dtype=torch.int32),
                depths=torch.tensor([[0, 1, 1, 2], [0, -1, -1, -1]], dtype=torch.int32),
                scores=torch.tensor([[0.0, -0.5, -1.0, -1.2], [0.0, float("-inf"), float("-inf"), float("-inf")]]),
                num_nodes=torch.tensor([4, 1], dtype=torch.int32))


def test_graft_shares_nodes_and_appends_the_rest():
    tree, added = graft_chains(small_tree(), [[7, 8, 5, 6], [3]])
    assert added == [[0, 0, 1, 2], [1]]
    assert tree.num_nodes.tolist() == [6, 2]
    assert tree.tokens[0, :6].tolist() == [1, 7, 9, 8, 5, 6]
    assert tree.parents[0, :6].tolist() == [-1, 0, 0, 1, 3, 4]
    assert tree.depths[0, :6].tolist() == [0, 1, 1, 2, 3, 4]
    assert tree.tokens[1, :2].tolist() == [2, 3] and tree.parents[1].tolist()[:3] == [-1, 0, -1]
    assert tree.depths[1].tolist()[2:] == [-1] * 4
    assert tree.scores[0, :4].tolist() == small_tree().scores[0].tolist()
    assert torch.isinf(tree.scores[0, 4:]).all() and torch.isinf(tree.scores[1, 1:]).all()
    for b in range(2):  # the shared layout: parents before children
        n = int(tree.num_nodes[b])
        assert all(0 <= int(tree.parents[b, i]) < i for i in range(1, n))


def test_graft_without_chains_is_the_same_tree():
    tree = small_tree()
    same, added = graft_chains(tree, [[], []])
    assert same is tree and added == [[], []]
    with pytest.raises(ValueError, match="one chain per row"):
        graft_chains(tree, [[1]])


def test_grafted_tree_verifies_like_a_walk():
    """verify_tree over a grafted tree follows the target's tokens into the new branch."""
    from dartree_ext import ops
    tree, _ = graft_chains(small_tree(), [[7, 8, 5, 6], [3, 4]])
    target = torch.zeros_like(tree.tokens)
    # row 0: after root 7, after 7 8, after 8 5, after 5 0 (reject 6); row 1: after root 3, after 3 4
    target[0, 0], target[0, 1], target[0, 3], target[0, 4], target[0, 5] = 7, 8, 5, 0, 0
    target[1, 0], target[1, 1], target[1, 2] = 3, 4, 11
    nodes, length, bonus = ops.verify_tree(tree.tokens, tree.parents, tree.num_nodes, target)
    assert length.tolist() == [3, 2] and bonus.tolist() == [0, 11]
    assert nodes[0, :4].tolist() == [0, 1, 3, 4]


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    gen = torch.Generator().manual_seed(7)
    base = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 11, 1)]
    # repeat each prompt so the context has continuations to find
    prompts = [torch.cat([p, p]) for p in base]
    refs = [greedy_reference(target, p, 24) for p in prompts]
    return target, tiny_drafter(target), prompts, refs


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_lookup_is_lossless_for_every_method(setup, method):
    target, drafter, prompts, refs = setup
    dec = SpeculativeDecoder(target, drafter, method, budget=16, width=4, K=8, lookup=6)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.lookup_rounds > 0


def test_lookup_raises_tau_with_an_oracle_context(setup):
    """The target's own output, given in the prompt: the continuation is the answer."""
    target, drafter, prompts, refs = setup
    primed = [torch.cat([p, r, p]) for p, r in zip(prompts, refs)]
    primed_refs = [greedy_reference(target, p, 24) for p in primed]
    plain = check_greedy(SpeculativeDecoder(target, drafter, "chain", budget=8, lookup=0), primed, primed_refs)
    looked = check_greedy(SpeculativeDecoder(target, drafter, "chain", budget=8, lookup=8), primed, primed_refs)
    alone = check_greedy(SpeculativeDecoder(target, None, "lookup", budget=8), primed, primed_refs)
    assert looked.stats.lookup_accepted > 0
    assert looked.stats.tau > plain.stats.tau + 1.0 and alone.stats.tau > 2.0


def test_auto_cuts_the_continuation_by_cost(setup):
    """With nodes nearly free the whole continuation is verified; with every node costing a
    plain step, none is."""
    target, drafter, prompts, refs = setup
    primed = [torch.cat([p, r, p]) for p, r in zip(prompts, refs)]
    primed_refs = [greedy_reference(target, p, 24) for p in primed]
    free = CostModel.from_curve({0: 10.0, 10 ** 6: 10.5})
    dear = CostModel.from_curve({0: 10.0, 1: 20.0, 10 ** 6: 10.0 * 10 ** 6})
    cheap = check_greedy(SpeculativeDecoder(target, None, "lookup", budget="auto", cost_model=free, lookup=6),
                         primed, primed_refs)
    costly = check_greedy(SpeculativeDecoder(target, None, "lookup", budget="auto", cost_model=dear, lookup=6),
                          primed, primed_refs)
    assert cheap.stats.lookup_rounds > 0 and cheap.stats.tau > 2.0
    assert costly.stats.lookup_rounds == 0 and costly.stats.tau == 1.0


def test_lookup_steps_pick_the_analytic_optimum(setup):
    """One row, a 3-token continuation with path probabilities 0.9, 0.45, 0.09 on a linear cost
    curve 10 + 2 n: rates 1 / 10, 1.9 / 12, 2.35 / 14, 2.44 / 16 -> 2 steps."""
    target, drafter, _, _ = setup
    dec = SpeculativeDecoder(target, None, "lookup", budget="auto", lookup=3,
                             cost_model=CostModel.from_curve({0: 10.0, 100: 210.0}))
    stats = dec.learned.lookup_stats("greedy")
    stats.prior[3, :3] = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    tree = dec.plain_tree(torch.tensor([1]))
    chains = [[4, 5, 6]]
    _, added = graft_chains(tree, chains)
    dec.sizing.chosen_expected = 0.0
    assert dec.sizing.lookup_steps(tree, chains, [4], added, 0, 0) == 2
    stats.prior[3, :3] = torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64)
    assert dec.sizing.lookup_steps(tree, chains, [4], added, 0, 0) == 3
    stats.prior[3, :3] = torch.tensor([0.1, 0.9, 0.9], dtype=torch.float64)
    assert dec.sizing.lookup_steps(tree, chains, [4], added, 0, 0) == 0


def test_lookup_bad_input(setup):
    target, drafter, _, _ = setup
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="lookup must be an int"):
            SpeculativeDecoder(target, drafter, "chain", lookup=bad)
    with pytest.raises(ValueError, match="plain decoding"):
        SpeculativeDecoder(target, drafter, "ar", lookup=4)
    with pytest.raises(ValueError, match="needs lookup"):
        SpeculativeDecoder(target, None, "lookup", lookup=0)


def test_lookup_defaults(setup):
    target, drafter, _, _ = setup
    assert SpeculativeDecoder(target, drafter, "dartree", budget=16).lookup == 0  # the papers' fixed trees
    assert SpeculativeDecoder(target, None, "lookup").lookup == 10
    auto = SpeculativeDecoder(target, drafter, "dartree", budget="auto", cost_model=CostModel.from_curve({0: 1.0}))
    assert auto.lookup == 10
    assert SpeculativeDecoder(target, drafter, "ar").lookup == 0


def test_lookup_batch_rows_finish_at_different_times(setup):
    """Rows leave the batch mid-run (max_new_tokens differs by stop token): the index of each
    request stays its own."""
    target, drafter, prompts, refs = setup
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=8, width=4, K=8, lookup=5)
    stop = int(refs[1][5])
    ids, mask = left_pad(prompts)
    out = dec.generate(ids, mask, max_new_tokens=24, stop_token_ids=[stop])
    width = ids.shape[1]
    for b, ref in enumerate(refs):
        ref = ref.tolist()
        end = ref.index(stop) + 1 if stop in ref else 24
        assert out.sequences[b, width:width + end].tolist() == ref[:end]


def test_lookup_longer_than_the_learned_depths(setup):
    """A continuation longer than LookupStats' 16 learned depths (lookup=24): the tokens past them
    add no expected acceptance, and decoding stays lossless (it raised IndexError before)."""
    target, drafter, _, _ = setup
    gen = torch.Generator().manual_seed(3)
    block = torch.randint(0, 97, (30,), generator=gen)
    prompts = [torch.cat([block, block, block[:5]])]   # the prompt repeats: 25 tokens to copy
    refs = [greedy_reference(target, p, 24) for p in prompts]
    dec = SpeculativeDecoder(target, drafter, "dartree", budget="auto", width=4, K=8, lookup=24,
                             cost_model=CostModel.from_curve({0: 10.0, 4096: 10.5}, draft_ms=0.1))
    out = check_greedy(dec, prompts, refs, 24)
    assert out.stats.lookup_rounds > 0


# ---------------------------------------------------------------------------------------------
# corpus lookup


def brute_corpus_propose(docs, context, length, max_ngram=CORPUS_MAX_NGRAM):
    """The longest suffix of ``context`` (<= max_ngram) found inside one document, then the most
    frequent next token over its occurrences (ties: the smallest id; a document's end counts as
    a next token larger than every id and stops the chain)."""
    end = object()

    def occurrences(pattern):
        m = len(pattern)
        return [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if doc[i:i + m] == pattern]

    for n in range(min(max_ngram, len(context)), 0, -1):
        pattern = list(context[len(context) - n:])
        if occurrences(pattern):
            break
    else:
        return [], 0
    out = []
    while len(out) < length:
        nxt = [docs[d][i + len(pattern)] if i + len(pattern) < len(docs[d]) else end for d, i in occurrences(pattern)]
        counts = {}
        for t in nxt:
            counts[t] = counts.get(t, 0) + 1
        best = max(counts.values())
        ids = sorted(t for t, c in counts.items() if c == best and t is not end)
        if not ids:  # the document's end alone is the most frequent
            break
        out.append(ids[0])
        pattern.append(ids[0])
    return out, n


def test_suffix_array_is_the_sorted_suffixes():
    gen = torch.Generator().manual_seed(0)
    assert suffix_array([]).tolist() == []
    for trial in range(100):
        n = int(torch.randint(1, 60, (1,), generator=gen))
        tokens = torch.randint(0, 1 + trial % 5, (n,), generator=gen).tolist()
        assert suffix_array(tokens).tolist() == sorted(range(n), key=lambda i: tokens[i:])


def test_corpus_index_matches_a_scan():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        docs = [torch.randint(0, 4, (int(torch.randint(0, 25, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(int(torch.randint(1, 6, (1,), generator=gen)))]
        corpus = CorpusIndex(docs)
        for _ in range(10):
            context = torch.randint(0, 5, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
            for length, max_ngram in ((6, CORPUS_MAX_NGRAM), (3, 2)):
                assert corpus.propose(context, length, max_ngram) == brute_corpus_propose(docs, context, length, max_ngram), \
                    (docs, context, length, max_ngram)


def test_corpus_index_by_hand():
    corpus = CorpusIndex([[5, 6, 7, 8], [1, 6, 7, 9], [2, 6, 7, 9, 3]])
    assert corpus.documents == 3 and len(corpus) == 16
    assert corpus.propose([6, 7], 4) == ([9, 3], 2)      # 9 follows "6 7" twice, 8 once; then doc 3 goes on
    assert corpus.propose([5, 6, 7], 4) == ([8], 3)      # the longer match decides; doc 1 then ends
    assert corpus.propose([4, 4, 1, 6], 2) == ([7, 9], 2)
    assert corpus.propose([42], 3) == ([], 0)            # nothing matches
    assert corpus.propose([8], 3) == ([], 1)             # matches at a document's end: nothing follows
    assert corpus.propose([6, 7], 0) == ([], 0)
    assert CorpusIndex([]).propose([1, 2], 3) == ([], 0)
    assert CorpusIndex([[3, 4]]).propose([9, 3, 4, 3], 3) == ([4], 1)  # no match crosses two documents


def test_corpus_index_is_safe_across_threads():
    """One index shared by several threads (each bisection reads the suffixes at its own width):
    every thread's proposals equal the single-threaded ones, with the interpreter switching
    threads as often as it can."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 6, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(40)]
    corpus = CorpusIndex(docs)
    contexts = [torch.randint(0, 6, (int(torch.randint(1, 14, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(300)]
    expected = [corpus.propose(c, 8) for c in contexts]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(4) as pool:
            got = [list(pool.map(lambda c: corpus.propose(c, 8), contexts)) for _ in range(3)]
    finally:
        sys.setswitchinterval(interval)
    assert all(g == expected for g in got)


def test_corpus_index_counts_many_occurrences_from_a_sample():
    """Past 4096 matching occurrences the next token's counts come from an even sample of them
    (the suffixes sharing a next token are contiguous, so a clear majority stays the majority)."""
    docs = [[1, 2, 3, 5]] * 6000 + [[1, 2, 4, 6]] * 3000 + [[7, 1, 2, 4]] * 10
    assert CorpusIndex(docs).propose([9, 1, 2], 3) == ([3, 5], 2)


@pytest.mark.parametrize("big", [False, True])
def test_corpus_save_load_round_trip(tmp_path, big):
    docs = [[1, 2, 3, 70000 if big else 7], [2, 3, 4], [65534, 2, 3]]
    corpus = CorpusIndex(docs)
    corpus.save(str(tmp_path / "c.npz"))
    back = load_corpus(str(tmp_path / "c.npz"))
    assert back.tokens.tolist() == corpus.tokens.tolist() and back.sa.tolist() == corpus.sa.tolist()
    for context in ([2, 3], [1, 2], [65534], [9]):
        assert back.propose(context, 4) == corpus.propose(context, 4)
    (tmp_path / "d").mkdir()
    assert load_corpus(str(tmp_path / "d")) is None      # a drafter directory without a corpus
    corpus.save(str(tmp_path / "d" / "corpus.npz"))
    assert load_corpus(str(tmp_path / "d")).propose([2, 3], 4) == corpus.propose([2, 3], 4)
    assert load_corpus(None) is None


def test_corpus_bad_input(tmp_path, setup):
    with pytest.raises(ValueError, match="corpus token ids"):
        CorpusIndex([[1, -2]])
    with pytest.raises(FileNotFoundError, match="no corpus"):
        load_corpus(str(tmp_path / "missing.npz"))
    target, drafter, _, _ = setup
    with pytest.raises(TypeError, match="CorpusIndex"):
        SpeculativeDecoder(target, drafter, "dartree", budget=16, lookup=4, corpus=[[1, 2]])
    assert SpeculativeDecoder(target, drafter, "dartree", budget=16, corpus=CorpusIndex([[1, 2]])).corpus is None  # no lookup


@pytest.fixture(scope="module")
def corpus_setup(setup):
    """Prompts that do not repeat (nothing to copy from the context), and a corpus holding the
    target's own answers to them, among unrelated documents."""
    target, drafter, _, _ = setup
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (7, 12, 3)]
    refs = [greedy_reference(target, p, 24) for p in prompts]
    noise = [torch.randint(0, 97, (40,), generator=gen).tolist() for _ in range(5)]
    corpus = CorpusIndex(noise + [torch.cat([p, r]).tolist() for p, r in zip(prompts, refs)])
    return target, drafter, prompts, refs, corpus


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_corpus_lookup_is_lossless_for_every_method(corpus_setup, method):
    target, drafter, prompts, refs, corpus = corpus_setup
    dec = SpeculativeDecoder(target, drafter, method, budget=16, width=4, K=8, lookup=6, corpus=corpus)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.corpus_rounds > 0 and out.stats.corpus_accepted > 0
    assert out.stats.corpus_rounds <= out.stats.lookup_rounds


def test_corpus_raises_tau_where_the_context_has_nothing(corpus_setup):
    target, drafter, prompts, refs, corpus = corpus_setup
    plain = check_greedy(SpeculativeDecoder(target, drafter, "chain", budget=8, lookup=8), prompts, refs)
    looked = check_greedy(SpeculativeDecoder(target, drafter, "chain", budget=8, lookup=8, corpus=corpus), prompts, refs)
    alone = check_greedy(SpeculativeDecoder(target, None, "lookup", budget=64, lookup=8, corpus=corpus), prompts, refs)
    assert plain.stats.corpus_rounds == 0
    assert looked.stats.tau > plain.stats.tau + 1.0 and alone.stats.tau > 2.0
    auto = SpeculativeDecoder(target, drafter, "dartree", budget="auto", width=4, K=8, corpus=corpus,
                              cost_model=CostModel.from_curve({0: 10.0, 4096: 10.5}, draft_ms=0.1))
    out = check_greedy(auto, prompts, refs)
    assert out.stats.corpus_accepted > 0 and auto.learned.lookup_stats("corpus-greedy").hits.sum() > 0  # learned in its own table
    assert auto.learned.lookup_stats("greedy").hits.sum() == 0 or out.stats.lookup_rounds > out.stats.corpus_rounds


def test_corpus_lookup_samples_at_t1(corpus_setup):
    """At T > 0 the corpus is consulted only with ``corpus_sampling=True``; its continuations are
    then verified like any other branch, with the sampling regime's statistics."""
    target, drafter, prompts, _, corpus = corpus_setup
    ids, mask = left_pad(prompts)
    for sampling in (True, False):
        dec = SpeculativeDecoder(target, drafter, "dartree", budget=8, width=4, K=8, lookup=6, corpus=corpus,
                                 corpus_sampling=sampling)
        out = dec.generate(ids, mask, max_new_tokens=12, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert all(r.new_tokens == 12 for r in out.stats.requests)
        corpus_stats = dec.learned.lookup_stats("corpus-sample")
        assert dec.learned.lookup_stats("corpus-greedy").trials.sum() == 0
        assert (corpus_stats.trials.sum() + corpus_stats.agree_trials.sum() > 0) == sampling
        assert (out.stats.corpus_rounds > 0) == sampling
