"""select_top_w, select_top_b and ddtree_heap against the reference on every backend; a property
test that select_top_b is the heap (and prefix-closed) on any scores; bad input."""
from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dartree_ext import ops, reference
from dartree_ext.testing import random_batch
from test_tree_ops import assert_same


def tie_heavy(shape, gen, levels=4):
    """Scores from a few values so that ties are everywhere."""
    return -torch.randint(0, levels, shape, generator=gen).float() * 0.5


# select_top_w ----------------------------------------------------------------------------------

def test_select_top_w_hand_built(backend):
    parent_scores = torch.tensor([[0.0, -1.0, -5.0]])
    child_logprobs = torch.tensor([[[-0.1, -2.0], [-0.5, -0.1], [0.0, 0.0]]])
    num_parents = torch.tensor([2], dtype=torch.int32)  # parent 2 is not valid
    out = backend.ops.select_top_w(*backend.put(parent_scores, child_logprobs, num_parents), 5)
    assert_same(out, (torch.tensor([[0, 1, 1, 0, -1]], dtype=torch.int32),
                      torch.tensor([[0, 1, 0, 1, -1]], dtype=torch.int32),
                      torch.tensor([[-0.1, -1.1, -1.5, -2.0, float("-inf")]])))


def test_select_top_w_ties_by_flat_index(backend):
    parent_scores = torch.zeros(1, 2)
    child_logprobs = torch.zeros(1, 2, 3)
    out = backend.ops.select_top_w(*backend.put(parent_scores, child_logprobs, torch.tensor([2], dtype=torch.int32)), 4)
    assert out[0].cpu().tolist() == [[0, 0, 0, 1]] and out[1].cpu().tolist() == [[0, 1, 2, 0]]


@pytest.mark.parametrize("p_max, k", [(1, 1), (5, 3), (12, 64), (3, 130)])
@pytest.mark.parametrize("width", [1, 12, 50])
@pytest.mark.parametrize("ties", [False, True])
def test_select_top_w_random(backend, p_max, k, width, ties):
    gen = torch.Generator().manual_seed(p_max * 1000 + k + width)
    batch = 4
    make = (lambda shape: tie_heavy(shape, gen)) if ties else (lambda shape: torch.randn(shape, generator=gen))
    parent_scores, child_logprobs = make((batch, p_max)), make((batch, p_max, k))
    child_logprobs[0, 0, 0] = float("nan")  # NaN ranks as -inf everywhere
    num_parents = torch.tensor([p_max, 0, max(1, p_max // 2), p_max], dtype=torch.int32)
    expected = reference.select_top_w(parent_scores, child_logprobs, num_parents, width)
    assert_same(backend.ops.select_top_w(*backend.put(parent_scores, child_logprobs, num_parents), width,
                                           validate=False), expected)


# select_top_b ----------------------------------------------------------------------------------

def heap_select(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """Best-first heap over the tree with heapq: the definition select_top_b implements."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    clean = [float("-inf") if s != s else s for s in scores]
    frontier = [(-clean[c], c) for c in children.get(0, [])]
    heapq.heapify(frontier)
    kept = [0]
    while frontier and len(kept) <= budget:
        _, node = heapq.heappop(frontier)
        kept.append(node)
        for c in children.get(node, []):
            heapq.heappush(frontier, (-clean[c], c))
    return sorted(kept)


def monotone_scores(parents: torch.Tensor, gen: torch.Generator, ties: bool) -> torch.Tensor:
    """Scores that never increase along a path: parent score + a log-prob <= 0 (often 0 with ties)."""
    batch, n_max = parents.shape
    step = tie_heavy((batch, n_max), gen, levels=3) if ties else -torch.rand(batch, n_max, generator=gen)
    scores = torch.zeros(batch, n_max)
    for i in range(1, n_max):
        p = parents[:, i].long().clamp(min=0)
        scores[:, i] = scores.gather(1, p[:, None])[:, 0] + step[:, i] - 0.2
    return scores


@pytest.mark.parametrize("n_max", [1, 2, 65, 193])
@pytest.mark.parametrize("budget", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("scores_kind", ["monotone", "monotone_ties", "random"])
def test_select_top_b_random(backend, n_max, budget, scores_kind):
    gen = torch.Generator().manual_seed(n_max + budget)
    parents, num_nodes = random_batch(3, n_max, seed=n_max + 7, kind="bushy")
    if scores_kind == "random":
        scores = torch.randn(3, n_max, generator=gen)
    else:
        scores = monotone_scores(parents, gen, ties=scores_kind == "monotone_ties")
    expected = reference.select_top_b(parents, scores, num_nodes, budget)
    assert_same(backend.ops.select_top_b(*backend.put(parents, scores, num_nodes), budget), expected)
    keep, _, num_kept = expected
    for b in range(3):  # the reference itself agrees with the heap definition
        n = int(num_nodes[b])
        want = heap_select(parents[b, :n].tolist(), scores[b, :n].tolist(), budget)
        assert keep[b, : int(num_kept[b])].tolist() == want


def test_select_top_b_supertree_shape(backend):
    # DARTree's shape: 16 depths x 12 children each, pruned to 64
    gen = torch.Generator().manual_seed(5)
    depth, width, batch = 16, 12, 2
    parents = [-1] + [0] * width
    for d in range(1, depth):
        first = 1 + (d - 1) * width
        parents += [first + int(torch.randint(0, width, (1,), generator=gen)) for _ in range(width)]
    parents = torch.tensor([parents] * batch, dtype=torch.int32)
    num_nodes = torch.full((batch,), parents.shape[1], dtype=torch.int32)
    scores = monotone_scores(parents, gen, ties=True)
    out = backend.ops.select_top_b(*backend.put(parents, scores, num_nodes), 64)
    assert_same(out, reference.select_top_b(parents, scores, num_nodes, 64))
    assert out[2].cpu().tolist() == [65, 65]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_select_top_b_is_the_heap_and_prefix_closed(data):
    n = data.draw(st.integers(1, 40))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    monotone = data.draw(st.booleans())
    values = st.sampled_from([0.0, -0.5, -1.0, -2.0, float("nan")]) if not monotone else st.sampled_from([0.0, -0.5])
    steps = [data.draw(values) for _ in range(n)]
    scores = [0.0] * n
    for i in range(1, n):
        scores[i] = (scores[parents[i]] + steps[i]) if monotone else steps[i]
    budget = data.draw(st.integers(0, n + 2))
    p = torch.tensor([parents], dtype=torch.int32)
    s = torch.tensor([scores], dtype=torch.float32)
    keep, new_parents, num_kept = ops.select_top_b(p, s, torch.tensor([n], dtype=torch.int32), budget,
                                                validate=False)  # (NaN ranks as -inf)
    kept = keep[0, : int(num_kept[0])].tolist()
    assert kept == heap_select(parents, scores, budget)
    assert keep[0, int(num_kept[0]):].tolist() == [-1] * (budget + 1 - int(num_kept[0]))
    position = {node: slot for slot, node in enumerate(kept)}
    for slot, node in enumerate(kept):  # prefix-closed, and new_parents point at the parent's slot
        assert new_parents[0, slot] == (-1 if node == 0 else position[parents[node]])


# ddtree_heap -----------------------------------------------------------------------------------

def sorted_logprobs(batch, depth, k, gen, ties):
    raw = tie_heavy((batch, depth, k), gen, levels=3) if ties else torch.randn(batch, depth, k, generator=gen)
    return torch.sort(raw - 1.0, dim=-1, descending=True).values


@pytest.mark.parametrize("depth, k", [(1, 1), (3, 4), (16, 64), (5, 2)])
@pytest.mark.parametrize("budget", [0, 1, 10, 64, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_ddtree_heap_random(backend, depth, k, budget, ties):
    gen = torch.Generator().manual_seed(depth * 100 + k + budget)
    batch = 3
    logprobs = sorted_logprobs(batch, depth, k, gen, ties)
    token_ids = torch.randint(0, 50_000, (batch, depth, k), generator=gen)
    root_tokens = torch.randint(0, 50_000, (batch,), generator=gen)
    expected = reference.ddtree_heap(logprobs, token_ids, root_tokens, budget)
    assert_same(backend.ops.ddtree_heap(*backend.put(logprobs, token_ids, root_tokens), budget), expected)


def test_ddtree_heap_hand_built(backend):
    # two positions, two candidates each: a, b at depth 1; c, d at depth 2
    logprobs = torch.tensor([[[-0.1, -1.0], [-0.2, -3.0]]])
    token_ids = torch.tensor([[[10, 11], [20, 21]]])
    out = backend.ops.ddtree_heap(*backend.put(logprobs, token_ids, torch.tensor([7])), 4)
    # pops: a (-0.1), a>c (-0.3), b (-1.0), b>c (-1.2)
    assert_same(out, (torch.tensor([[7, 10, 20, 11, 20]]), torch.tensor([[-1, 0, 1, 0, 3]], dtype=torch.int32),
                      torch.tensor([[0, 1, 2, 1, 2]], dtype=torch.int32),
                      torch.tensor([[0.0, -0.1, -0.1 + -0.2, -1.0, -1.0 + -0.2]]),
                      torch.tensor([5], dtype=torch.int32)))


def test_ddtree_heap_runs_out_of_nodes(backend):
    logprobs = torch.tensor([[[-0.1]]])
    out = backend.ops.ddtree_heap(*backend.put(logprobs, torch.tensor([[[3]]]), torch.tensor([1])), 5)
    assert out[4].cpu().tolist() == [2]
    assert out[1].cpu().tolist() == [[-1, 0, -1, -1, -1, -1]]


@pytest.mark.parametrize("depth, k, budget", [(16, 64, 64),     # log-probs and ids staged in shared memory
                                              (16, 64, 2000),   # log-probs only
                                              (32, 400, 2048)])  # neither: read from global memory
def test_ddtree_heap_every_shared_memory_layout(backend, depth, k, budget):
    """The CUDA kernel stages a request's candidates in shared memory as far as 48 KiB allow
    next to its heap: each of its three layouts gives the reference's tree."""
    gen = torch.Generator().manual_seed(budget)
    logprobs = sorted_logprobs(2, depth, k, gen, ties=True)
    token_ids = torch.randint(0, 50_000, (2, depth, k), generator=gen)
    root_tokens = torch.randint(0, 50_000, (2,), generator=gen)
    expected = reference.ddtree_heap(logprobs, token_ids, root_tokens, budget)
    assert_same(backend.ops.ddtree_heap(*backend.put(logprobs, token_ids, root_tokens), budget), expected)
