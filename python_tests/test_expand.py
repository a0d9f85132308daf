"""expand_depth and build_supertree against the per-depth PyTorch reference on every backend and
dtype; build_dartree / seq_heap: with the supertree wide enough to hold every node, pruning it
equals the exact sequential heap."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dartree_ext import ops, reference
from dartree_ext.head import CorrectionHeadWeights
from dartree_ext.tree import build_dartree, candidates, seq_heap, supertree_as_tree, prune

VOCAB, HIDDEN, E, G = 40, 24, 16, 8
# accumulation is float32 on every backend, from the same (exactly converted) inputs: only the
# summation order differs, so one tolerance serves every weight dtype
ATOL = 2e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_inputs(batch, depth, k, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    head = CorrectionHeadWeights.random(VOCAB, HIDDEN, E, G, dtype=dtype, seed=seed, bias=bias)
    z = (torch.randn(batch, depth, E, generator=gen)).to(dtype)
    # distinct candidate ids per position, as top-K gives
    cand_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(batch * depth)]).view(batch, depth, k)
    cand_base = (torch.randn(batch, depth, k, generator=gen) * 2).to(dtype)
    root_state = torch.randn(batch, G, generator=gen).to(dtype)
    return head, z, cand_ids, cand_base, root_state


def head_on(head, device):
    return CorrectionHeadWeights(**{f.name: None if getattr(head, f.name) is None else getattr(head, f.name).to(device)
                                    for f in head.__dataclass_fields__.values()})


def assert_expansion_close(actual, expected):
    for a, e in zip(actual, expected):
        a = a.cpu()
        assert a.dtype == e.dtype and a.shape == e.shape
        if a.is_floating_point():
            torch.testing.assert_close(a, e, atol=ATOL, rtol=1e-5)
        else:
            assert torch.equal(a, e), f"\n{a}\nvs\n{e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p_max, k, width", [(1, 5, 3), (3, 5, 4), (3, 4, 20), (2, 1, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_expand_depth(backend, dtype, p_max, k, width, bias):
    batch = 3
    head, z, cand_ids, cand_base, _ = make_inputs(batch, 1, k, dtype, seed=p_max * 10 + k + width, bias=bias)
    gen = torch.Generator().manual_seed(1)
    parent_states = torch.randn(batch, p_max, G, generator=gen)
    parent_scores = -torch.rand(batch, p_max, generator=gen)
    num_parents = torch.tensor([p_max, max(0, p_max - 1), 1], dtype=torch.int32)
    args = (z[:, 0].contiguous(), cand_ids[:, 0].contiguous(), cand_base[:, 0].contiguous(), parent_states,
            parent_scores, num_parents)
    expected = reference.expand_depth(head, *args, width, -0.2)
    actual = backend.ops.expand_depth(head_on(head, backend.device), *backend.put(*args), width, -0.2)
    assert_expansion_close(actual, expected)


@pytest.mark.parametrize("width", [3, np.int64(3), np.int32(3)])
def test_build_supertree_integer_width(backend, width):
    """An integer width of any integer type is that width at every depth, in the op (and its
    emulation) and in the reference alike."""
    head, z, cand_ids, cand_base, root_state = make_inputs(2, 3, 5, torch.float32, seed=11)
    expected = reference.build_supertree(head, z, cand_ids, cand_base, root_state, [3, 3, 3], -0.2)
    assert_expansion_close(reference.build_supertree(head, z, cand_ids, cand_base, root_state, width, -0.2), expected)
    actual = backend.ops.build_supertree(head_on(head, backend.device), *backend.put(z, cand_ids, cand_base,
                                                                                   root_state), width, -0.2)
    assert_expansion_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth, k, widths", [(1, 6, [4]), (4, 5, [3, 6, 2, 5]), (3, 2, [4, 4, 4])])
def test_build_supertree(backend, dtype, depth, k, widths):
    batch = 2
    head, z, cand_ids, cand_base, root_state = make_inputs(batch, depth, k, dtype, seed=depth + k)
    expected = reference.build_supertree(head, z, cand_ids, cand_base, root_state, widths, -0.2)
    actual = backend.ops.build_supertree(head_on(head, backend.device), *backend.put(z, cand_ids, cand_base,
                                                                                   root_state), widths, -0.2)
    assert_expansion_close(actual, expected)
    tokens, parents, depths, scores = (t.cpu() for t in actual)
    # topological and depth-consistent; scores never increase along a path (log q <= 0, bonus < 0)
    for b in range(batch):
        for i in range(tokens.shape[1]):
            if depths[b, i] < 0:
                continue
            p = int(parents[b, i])
            assert p < i
            assert int(depths[b, i]) == (1 if p < 0 else int(depths[b, p]) + 1)
            assert p < 0 or scores[b, i] <= scores[b, p]


@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_saturated_gates(backend, scale):
    # gate pre-activations far outside [-88, 88] (the CPU kernel's own exp clamps there) and exactly 0:
    # sigmoid / tanh must saturate to 0, 1 / -1, 1 like torch's, with no NaN or inf in the states
    batch, depth, k, widths = 2, 3, 5, [4, 4, 4]
    head, z, cand_ids, cand_base, root_state = make_inputs(batch, depth, k, torch.float32, seed=7)
    head.gru_table.mul_(scale)
    head.w_hh.mul_(scale)
    head.gru_table[::3].zero_()
    expected = reference.build_supertree(head, z, cand_ids, cand_base, root_state, widths, -0.2)
    actual = backend.ops.build_supertree(head_on(head, backend.device),
                                         *backend.put(z, cand_ids, cand_base, root_state), widths, -0.2)
    assert all(torch.isfinite(t.float()[t.float() > -float("inf")]).all() for t in expected)
    assert_expansion_close(actual, expected)
    gen = torch.Generator().manual_seed(2)
    parent_states = torch.randn(batch, 3, G, generator=gen)  # the scaled weights saturate the gates already;
    parent_scores = -torch.tensor([[0.0, 0.3, 0.7], [0.1, 0.5, 0.9]])  # distinct: no float-rounding ties
    args = (z[:, 0].contiguous(), cand_ids[:, 0].contiguous(), cand_base[:, 0].contiguous(), parent_states,
            parent_scores, torch.tensor([3, 2], dtype=torch.int32))
    expected = reference.expand_depth(head, *args, 6, -0.2)
    actual = backend.ops.expand_depth(head_on(head, backend.device), *backend.put(*args), 6, -0.2)
    assert torch.isfinite(expected[4]).all()
    assert_expansion_close(actual, expected)


def test_full_supertree_pruned_equals_seq_heap():
    # widths K, K^2, K^3 hold every node: the global top-B is then exactly the sequential heap
    batch, depth, k, budget = 2, 3, 3, 10
    head, z, cand_ids, cand_base, root_state = make_inputs(batch, depth, k, torch.float32, seed=3)
    roots = torch.tensor([5, 6])
    supertree = reference.build_supertree(head, z, cand_ids, cand_base, root_state, [k, k * k, k ** 3], -0.2)
    tree = prune(supertree_as_tree(*supertree, roots), budget)
    exact = seq_heap(head, z, cand_ids, cand_base, roots, root_state, budget, -0.2)
    for b in range(batch):
        def paths(t):
            out = {}
            for i in range(int(t.num_nodes[b])):
                path, j = [], i
                while j >= 0:
                    path.append(int(t.tokens[b, j]))
                    j = int(t.parents[b, j])
                out[tuple(reversed(path))] = float(t.scores[b, i])
            return out
        ours, theirs = paths(tree), paths(exact)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5)


@pytest.mark.parametrize("fixed", [False, True])
def test_build_dartree_layout(fixed):
    batch, depth, budget = 2, 4, 8
    head = CorrectionHeadWeights.random(VOCAB, HIDDEN, E, G, seed=1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, depth, HIDDEN, generator=gen)
    logits = torch.randn(batch, depth, VOCAB, generator=gen)
    tree = build_dartree(head, hidden, logits, torch.tensor([1, 2]), torch.zeros(batch, G), k=6, width=3,
                         budget=budget, fixed=fixed)
    assert tree.tokens.shape[1] == (1 + depth * (budget // depth) if fixed else budget + 1)
    assert tree.num_nodes.tolist() == [budget + 1] * batch
    assert tree.tokens[:, 0].tolist() == [1, 2]
    for b in range(batch):
        for i in range(1, int(tree.num_nodes[b])):
            p = int(tree.parents[b, i])
            assert 0 <= p < i and int(tree.depths[b, i]) == int(tree.depths[b, p]) + 1
            # every token is one of the candidates at its depth
            ids, _ = candidates(logits[b:b + 1], 6)
            assert int(tree.tokens[b, i]) in ids[0, int(tree.depths[b, i]) - 1].tolist()


def test_build_dartree_per_depth_widths():
    """Per-depth widths: (w1, w2) = w1 at depth 1 and w2 below; the same tree as the supertree
    built with the expanded width list, pruned; an int is every depth's width."""
    from dartree_ext.tree import depth_widths, parse_width
    batch, depth, budget, k = 2, 4, 9, 6
    head = CorrectionHeadWeights.random(VOCAB, HIDDEN, E, G, seed=2)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch, depth, HIDDEN, generator=gen)
    logits = torch.randn(batch, depth, VOCAB, generator=gen)
    roots, state = torch.tensor([1, 2]), torch.zeros(batch, G)
    assert depth_widths((5, 2), depth) == [5, 2, 2, 2] and depth_widths(3, 2) == [3, 3]
    assert depth_widths((1, 2, 3, 4, 5), 3) == [1, 2, 3]
    assert parse_width("12") == 12 and parse_width("32,12") == (32, 12)
    # any integer type is one width for every depth (a numpy int is not iterable)
    assert depth_widths(np.int64(3), 2) == [3, 3] and depth_widths((np.int32(5), 2), 3) == [5, 2, 2]
    for bad in ((), (3, 0), 0, np.int64(0)):
        with pytest.raises(ValueError, match="widths must be >= 1"):
            depth_widths(bad, depth)
    with pytest.raises(ValueError, match="integers"):
        parse_width("12,x")
    tree = build_dartree(head, hidden, logits, roots, state, k=k, width=(5, 2), budget=budget)
    cand_ids, cand_base = candidates(logits, k)
    sup = reference.build_supertree(head, head.project(hidden), cand_ids, cand_base, state, [5, 2, 2, 2], -0.2)
    expected = prune(supertree_as_tree(*sup, roots), budget)
    for field in ("tokens", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(tree, field), getattr(expected, field)), field
    assert (tree.depths == 1).sum(1).tolist() == [5, 5]      # depth 1 is wider than W = 2 would allow
    same = build_dartree(head, hidden, logits, roots, state, k=k, width=(3,), budget=budget)
    plain = build_dartree(head, hidden, logits, roots, state, k=k, width=3, budget=budget)
    assert torch.equal(same.tokens, plain.tokens) and torch.equal(same.parents, plain.parents)
    numpy_width = build_dartree(head, hidden, logits, roots, state, k=k, width=np.int64(3), budget=budget)
    assert torch.equal(numpy_width.tokens, plain.tokens) and torch.equal(numpy_width.parents, plain.parents)


def test_out_of_range_candidate_ids(backend):
    """CPU: a ValueError naming cand_ids. CUDA (emulated and real, which cannot raise without a
    synchronization): an id outside [0, V) is never read and scores -inf, so the expansion equals
    the reference with those candidates' base logits at -inf; a row with no valid id gives -inf
    children and reads nothing."""
    batch, depth, k, widths = 2, 3, 5, [3, 3, 3]
    head, z, cand_ids, cand_base, root_state = make_inputs(batch, depth, k, torch.float32, seed=5)
    bad = cand_ids.clone()
    bad[0, 0, 1], bad[1, 1, 4], bad[1, 2, 0] = VOCAB, 2 ** 40, -3   # just past the end, far away, negative
    if backend.name == "cpu":
        with pytest.raises(ValueError, match=r"cand_ids must be token ids in \[0, 40\)"):
            backend.ops.build_supertree(head, z, bad, cand_base, root_state, widths, -0.2)
        return
    masked_base = torch.where(bad != cand_ids, float("-inf"), cand_base)
    expected = reference.build_supertree(head, z, cand_ids, masked_base, root_state, widths, -0.2)
    actual = backend.ops.build_supertree(head_on(head, backend.device), *backend.put(z, bad, cand_base, root_state),
                                         widths, -0.2)
    assert_expansion_close(actual, expected)
    none_valid = cand_ids.clone()
    none_valid[0, 0, :] = VOCAB + 7
    tokens, parents, depths, scores = (t.cpu() for t in backend.ops.build_supertree(
        head_on(head, backend.device), *backend.put(z, none_valid, cand_base, root_state), widths, -0.2))
    assert bool(torch.isneginf(scores[0]).all()) and bool(torch.isfinite(scores[1]).all())


@pytest.mark.parametrize("g, ok", [(3040, True), (3041, False)])
def test_head_state_size_limit(g, ok):
    """G is checked against what the CUDA update kernel's shared memory holds without opting in
    (4 G floats + 33 candidates <= 48 KiB): G = 3041 is refused on every backend with a clear error."""
    from dartree_ext import ops
    head = CorrectionHeadWeights.random(VOCAB, HIDDEN, 4, g, seed=0, bias=False)
    z, ids = torch.zeros(1, 1, 4), torch.arange(3)[None, None]
    args = (head, z, ids, torch.zeros(1, 1, 3), torch.zeros(1, g), [2], -0.2)
    if ok:
        ops.build_supertree(*args)
    else:
        with pytest.raises(ValueError, match="G <= 3040"):
            ops.build_supertree(*args)


@pytest.mark.parametrize("k,widths", [(3, [3, 5, 4]), (4, [2, 2, 2, 2]), (6, [6, 1, 3])])
def test_supertree_as_tree_unpadded_fast_path(k, widths):
    """With K >= every width there is no padding: the fast path (root prepended, parents shifted)
    gives the tree the general path (sort padding out) gives; with padding the general path
    drops it (K < W at depth 1)."""
    batch = 2
    head, z, cand_ids, cand_base, root_state = make_inputs(batch, len(widths), k, torch.float32, seed=k)
    roots = torch.tensor([7, 9])
    sup = ops.build_supertree(head, z, cand_ids, cand_base, root_state, widths, -0.2)
    assert bool((sup[2] >= 0).all())
    fast, general = supertree_as_tree(*sup, roots, padded=False), supertree_as_tree(*sup, roots)
    for field in ("tokens", "parents", "depths", "scores", "num_nodes"):
        assert torch.equal(getattr(fast, field), getattr(general, field)), field
        assert getattr(fast, field).dtype == getattr(general, field).dtype, field
    padded = ops.build_supertree(head, z, cand_ids, cand_base, root_state, [k + 2] + widths[1:], -0.2)
    assert bool((padded[2] < 0).any())
    tree = supertree_as_tree(*padded, roots)
    assert tree.num_nodes.tolist() == [1 + k + sum(widths[1:])] * batch
