"""tree_ancestor_bits, tree_attention_mask, tree_links and verify_tree against the reference, on
every backend, on hand-built and random trees."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import reference
from dartree_ext.testing import HAND_NUM_NODES, HAND_PARENTS, HAND_TOKENS, random_batch

SIZES = [1, 2, 63, 64, 65, 130, 193]
KINDS = ["random", "chain", "star", "bushy"]


def assert_same(actual, expected):
    if isinstance(expected, tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
        return
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), f"mismatch:\n{actual}\nvs\n{expected}"


# hand-built cases ------------------------------------------------------------------------------

def test_ancestor_bits_hand_built(backend):
    bits, depths = backend.ops.tree_ancestor_bits(*backend.put(HAND_PARENTS, HAND_NUM_NODES))
    rows = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 4, 6], 7: [7]}
    expected = torch.tensor([[[sum(1 << j for j in rows[i])] for i in range(8)]], dtype=torch.int64)
    assert_same(bits, expected)
    assert_same(depths, torch.tensor([[0, 1, 1, 2, 2, 2, 3, -1]], dtype=torch.int32))


def test_links_hand_built(backend):
    next_token, next_sibling = backend.ops.tree_links(*backend.put(HAND_PARENTS, HAND_NUM_NODES))
    assert_same(next_token, torch.tensor([[1, 3, 5, -1, 6, -1, -1, -1]], dtype=torch.int32))
    assert_same(next_sibling, torch.tensor([[-1, 2, -1, 4, -1, -1, -1, -1]], dtype=torch.int32))


def test_attention_mask_hand_built(backend):
    past_key_mask = torch.tensor([[False, True, True]])  # one left-padding slot
    mask = backend.ops.tree_attention_mask(*backend.put(HAND_PARENTS, HAND_NUM_NODES, past_key_mask),
                                           torch.float32).cpu()
    visible = mask[0, 0] == 0
    hidden_value = torch.finfo(torch.float32).min
    assert torch.all((mask == 0) | (mask == hidden_value))
    assert visible[6].tolist() == [False, True, True, True, True, False, False, True, False, True, False]
    assert visible[2].tolist() == [False, True, True, True, False, True, False, False, False, False, False]
    # the padding node sees only itself: no past, no other node
    assert visible[7].tolist() == [False] * 10 + [True]


@pytest.mark.parametrize("targets, path, bonus", [
    ([5, 8, 7, 0, 9, 0, 42, 0], [0, 1, 4, 6], 42),  # root -> 1 -> 4 -> 6, bonus after 6
    ([6, 0, 7, 0, 0, 3, 0, 0], [0, 2, 5], 3),
    ([1, 0, 0, 0, 0, 0, 0, 0], [0], 1),  # nothing accepted: the bonus is the target after the root
    ([5, 7, 0, 11, 0, 0, 0, 0], [0, 1, 3], 11),
])
def test_verify_hand_built(backend, targets, path, bonus):
    target_tokens = torch.tensor([targets], dtype=torch.int64)
    accept_nodes, accept_len, bonus_out = backend.ops.verify_tree(
        *backend.put(HAND_TOKENS, HAND_PARENTS, HAND_NUM_NODES, target_tokens))
    assert_same(accept_nodes, torch.tensor([path + [-1] * (8 - len(path))], dtype=torch.int32))
    assert_same(accept_len, torch.tensor([len(path) - 1], dtype=torch.int32))
    assert_same(bonus_out, torch.tensor([bonus], dtype=torch.int64))


def test_verify_ties_go_to_lowest_index(backend):
    # root has three children with the same token; the walk must take node 1, whose child matches
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2]], dtype=torch.int32)
    tokens = torch.tensor([[0, 3, 3, 3, 4, 4]], dtype=torch.int64)
    target = torch.tensor([[3, 4, 4, 0, 9, 9]], dtype=torch.int64)
    num_nodes = torch.tensor([6], dtype=torch.int32)
    accept_nodes, accept_len, bonus = backend.ops.verify_tree(*backend.put(tokens, parents, num_nodes, target))
    assert accept_nodes.cpu()[0, :3].tolist() == [0, 1, 4]
    assert int(accept_len) == 2 and int(bonus) == 9


# random cases against the reference ------------------------------------------------------------

@pytest.mark.parametrize("n_max", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_ancestor_bits_random(backend, n_max, kind):
    parents, num_nodes = random_batch(3, n_max, seed=n_max, kind=kind)
    assert_same(backend.ops.tree_ancestor_bits(*backend.put(parents, num_nodes)),
                reference.tree_ancestor_bits(parents, num_nodes))


@pytest.mark.parametrize("n_max", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_links_random(backend, n_max, kind):
    parents, num_nodes = random_batch(3, n_max, seed=100 + n_max, kind=kind)
    assert_same(backend.ops.tree_links(*backend.put(parents, num_nodes)),
                reference.tree_links(parents, num_nodes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n_max, past", [(1, 0), (2, 3), (65, 0), (65, 70), (130, 17)])
def test_attention_mask_random(backend, dtype, n_max, past):
    parents, num_nodes = random_batch(3, n_max, seed=200 + n_max + past)
    past_key_mask = torch.rand(3, past, generator=torch.Generator().manual_seed(past)) < 0.7
    actual = backend.ops.tree_attention_mask(*backend.put(parents, num_nodes, past_key_mask), dtype)
    assert_same(actual, reference.tree_attention_mask(parents, num_nodes, past_key_mask, dtype))


@pytest.mark.parametrize("n_max", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [2, 5])
def test_verify_random(backend, n_max, kind, vocab):
    # a tiny vocabulary makes matches (and ties among siblings) frequent
    gen = torch.Generator().manual_seed(300 + n_max + vocab)
    parents, num_nodes = random_batch(4, n_max, seed=300 + n_max, kind=kind)
    tokens = torch.randint(0, vocab, (4, n_max), generator=gen)
    target = torch.randint(0, vocab, (4, n_max), generator=gen)
    assert_same(backend.ops.verify_tree(*backend.put(tokens, parents, num_nodes, target)),
                reference.verify_tree(tokens, parents, num_nodes, target))


def test_verify_accepts_a_long_chain(backend):
    # the target agrees with every draft token of a 193-node chain: the whole chain is accepted
    n = 193
    parents, num_nodes = random_batch(2, n, seed=1, kind="chain", full=True)
    tokens = torch.arange(2 * n, dtype=torch.int64).view(2, n)
    target = torch.roll(tokens, -1, dims=1)
    accept_nodes, accept_len, bonus = backend.ops.verify_tree(*backend.put(tokens, parents, num_nodes, target))
    assert accept_len.cpu().tolist() == [n - 1, n - 1]
    assert torch.equal(accept_nodes.cpu()[0], torch.arange(n, dtype=torch.int32))
    assert bonus.cpu().tolist() == target[:, -1].tolist()


def test_large_tree_at_the_limit(backend):
    if backend.name == "emu":
        n_max = 1024  # fibers are slow; the limit itself is covered on CPU and CUDA
    else:
        n_max = 4096
    parents, num_nodes = random_batch(2, n_max, seed=7, kind="bushy")
    assert_same(backend.ops.tree_ancestor_bits(*backend.put(parents, num_nodes)),
                reference.tree_ancestor_bits(parents, num_nodes))


@pytest.mark.parametrize("kind", ["random", "bushy", "star"])
def test_ancestor_bits_at_the_node_limit(backend, kind):
    """N = 8192 (128 words a row): the CUDA kernel builds 16 rows a block in shared memory and
    writes them as one contiguous run; every row against the reference, on every backend."""
    parents, num_nodes = random_batch(1, 8192, seed=9, kind=kind)
    assert_same(backend.ops.tree_ancestor_bits(*backend.put(parents, num_nodes)),
                reference.tree_ancestor_bits(parents, num_nodes))


@pytest.mark.parametrize("kind", ["random", "star", "bushy"])
def test_links_large(backend, kind):
    """N = 8192: 256 chunks of 32 nodes for the CUDA kernel's sibling walk, siblings far apart
    (star: every node's next sibling is the next node; random: siblings across many chunks)."""
    parents, num_nodes = random_batch(2, 8192, seed=11, kind=kind)
    assert_same(backend.ops.tree_links(*backend.put(parents, num_nodes)), reference.tree_links(parents, num_nodes))
