"""Engine adapters: SGLang's verify inputs and accept outputs (against a walk written here exactly
as sgl-kernel's greedy tree verification walks its links), and FlashInfer's packed custom mask
(the op on every backend against the reference and an unpack in the test)."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import ops, reference
from dartree_ext.integrations import flashinfer, sglang
from dartree_ext.testing import HAND_NUM_NODES, HAND_PARENTS, HAND_TOKENS, random_batch
from dartree_ext.tree import Tree

KINDS = ["random", "chain", "star", "bushy"]


def make_tree(parents: torch.Tensor, num_nodes: torch.Tensor, seed: int = 0, vocab: int = 5) -> Tree:
    """A tree with random tokens, siblings distinct (as every drafter's are)."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    for b in range(batch):
        used: dict[int, set] = {}
        for i in range(int(num_nodes[b])):
            p = int(parents[b, i]) if i else -1
            seen = used.setdefault(p, set())
            choices = [t for t in range(vocab + n) if t not in seen]
            t = choices[int(torch.randint(len(choices), (1,), generator=gen))] if i else int(
                torch.randint(vocab, (1,), generator=gen))
            seen.add(t)
            tokens[b, i] = t
    depths = reference.tree_ancestor_bits(parents, num_nodes)[1]
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=torch.zeros(batch, n), num_nodes=num_nodes)


def sgl_greedy_walk(inp: sglang.SGLangVerifyInputs, target_predict: torch.Tensor):
    """sgl-kernel's verify_tree_greedy, step by step in Python: from the root, try the children of
    the last accepted node through retrive_next_token / retrive_next_sibling; the first whose
    token equals the target's token after that node is accepted. Returns SGLang's outputs."""
    n = inp.draft_token_num
    batch = inp.retrive_index.shape[0]
    candidates = inp.draft_token.view(batch, n)
    steps = inp.spec_steps
    accept_index = torch.full((batch, steps + 1), -1, dtype=torch.int32)
    accept_token_num = torch.zeros(batch, dtype=torch.int32)
    predicts = torch.zeros(batch * n, dtype=torch.int32)
    for b in range(batch):
        last = int(inp.retrive_index[b, 0])
        accept_index[b, 0] = last
        cur = int(inp.retrive_next_token[b, 0])
        num = 0
        for _ in range(steps):
            while cur != -1:
                target = int(target_predict.view(-1)[last])
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    num += 1
                    last = int(inp.retrive_index[b, cur])
                    accept_index[b, num] = last
                    break
                cur = int(inp.retrive_next_sibling[b, cur])
            if cur == -1:
                break
            cur = int(inp.retrive_next_token[b, cur])
        accept_token_num[b] = num
        predicts[last] = int(target_predict.view(-1)[last])
    return accept_index, accept_token_num, predicts


def target_along_a_path(tree: Tree, gen: torch.Generator, follow: float = 0.8) -> torch.Tensor:
    """Target tokens that often match some child (so walks go deep), else a token no child has."""
    batch, n = tree.tokens.shape
    target = torch.full((batch, n), 10 ** 6, dtype=torch.int64)
    for b in range(batch):
        for i in range(int(tree.num_nodes[b])):
            kids = [j for j in range(1, int(tree.num_nodes[b])) if int(tree.parents[b, j]) == i]
            if kids and float(torch.rand((), generator=gen)) < follow:
                target[b, i] = tree.tokens[b, kids[int(torch.randint(len(kids), (1,), generator=gen))]]
    return target


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_max", [1, 2, 9, 33, 70])
def test_sglang_walk_matches_verify_tree(kind, n_max):
    gen = torch.Generator().manual_seed(n_max)
    parents, num_nodes = random_batch(3, n_max, seed=n_max, kind=kind)
    tree = make_tree(parents, num_nodes, seed=n_max)
    inp = sglang.verify_inputs(tree, torch.tensor([5, 0, 17]), mask_mode="qlen_only")
    for trial in range(4):
        target = target_along_a_path(tree, gen)
        nodes, length, bonus = ops.verify_tree(tree.tokens, tree.parents, tree.num_nodes, target)
        sgl = sgl_greedy_walk(inp, target)
        got = sglang.accept_from_sglang(*sgl, draft_token_num=n_max)
        assert torch.equal(got[0], nodes) and torch.equal(got[1], length) and torch.equal(got[2], bonus), trial


def test_sglang_fields_by_hand():
    tree = make_tree(HAND_PARENTS, HAND_NUM_NODES)
    tree = Tree(HAND_TOKENS.clone(), tree.parents, tree.depths, tree.scores, tree.num_nodes)
    inp = sglang.verify_inputs(tree, torch.tensor([10]), mask_mode="full")
    n = HAND_PARENTS.shape[1]
    assert inp.draft_token.tolist() == HAND_TOKENS[0].tolist()
    assert inp.positions.tolist() == [10, 11, 11, 12, 12, 12, 13, 10]  # padding node at seq_len
    assert inp.retrive_index.tolist() == [list(range(n))]
    assert inp.retrive_next_token.tolist() == [[1, 3, 5, -1, 6, -1, -1, -1]]
    assert inp.retrive_next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1, -1, -1]]
    assert inp.retrive_index.dtype == inp.retrive_next_token.dtype == torch.int64
    assert inp.tree_mask_mode == sglang.FULL_MASK and inp.topk > 1 and inp.spec_steps == n - 1
    full = inp.custom_mask.view(n, 10 + n)
    assert full[:, :10].all()
    assert full[6, 10:].tolist() == [True, True, False, False, True, False, True, False]
    assert full[7, 10:].tolist() == [False] * 7 + [True]


@pytest.mark.parametrize("n_max", [1, 5, 8, 9, 16, 17, 32])
def test_sglang_mask_modes_equal_the_ancestor_masks(n_max):
    parents, num_nodes = random_batch(3, n_max, seed=3, kind="random")
    tree = make_tree(parents, num_nodes)
    lens = torch.tensor([0, 7, 3])
    anc = reference.ancestor_matrix(parents, num_nodes)
    full = sglang.verify_inputs(tree, lens, "full", seq_lens_sum=10).custom_mask
    assert torch.equal(full, sglang.verify_inputs(tree, lens, "full").custom_mask)  # sum read back
    offset = 0
    for b, s in enumerate(lens.tolist()):
        block = full[offset:offset + n_max * (s + n_max)].view(n_max, s + n_max)
        assert block[:, :s].all() and torch.equal(block[:, s:], anc[b])
        offset += block.numel()
    assert offset == full.numel()
    qlen = sglang.verify_inputs(tree, lens, "qlen_only").custom_mask
    assert qlen.dtype == torch.bool and torch.equal(qlen.view(3, n_max, n_max), anc)
    packed = sglang.verify_inputs(tree, lens, "qlen_only_bitpacking").custom_mask
    width = 8 if n_max <= 8 else 16 if n_max <= 16 else 32
    assert packed.dtype == {8: torch.uint8, 16: torch.uint16, 32: torch.uint32}[width]
    assert packed.shape == (3 * n_max,)
    words = packed.to(torch.int64).view(3, n_max)
    unpacked = ((words[..., None] >> torch.arange(n_max)) & 1).bool()
    assert torch.equal(unpacked, anc)


def test_sglang_bad_input():
    parents, num_nodes = random_batch(2, 40, seed=1)
    tree = make_tree(parents, num_nodes)
    with pytest.raises(ValueError, match="32"):
        sglang.verify_inputs(tree, torch.tensor([1, 2]), "qlen_only_bitpacking")
    with pytest.raises(ValueError, match="mask_mode"):
        sglang.verify_inputs(tree, torch.tensor([1, 2]), "causal")
    with pytest.raises(ValueError, match="one length per request"):
        sglang.verify_inputs(tree, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integers"):
        sglang.verify_inputs(tree, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="predicts"):
        sglang.accept_from_sglang(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                  torch.zeros(5, dtype=torch.int32), 40)


# FlashInfer ---------------------------------------------------------------------------------------
def unpack_flashinfer(packed: torch.Tensor, indptr: torch.Tensor, n: int, lens: list[int]) -> list[torch.Tensor]:
    """numpy-free unpack of FlashInfer's layout: per request little-endian bits, [N, s + N]."""
    out = []
    for b, s in enumerate(lens):
        seg = packed[int(indptr[b]):int(indptr[b + 1])].to(torch.int64)
        bits = ((seg[:, None] >> torch.arange(8)) & 1).bool().reshape(-1)
        assert not bits[n * (s + n):].any(), "padding bits of the last byte must be zero"
        out.append(bits[:n * (s + n)].view(n, s + n))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_max", [1, 3, 64, 65, 130])
def test_packed_tree_mask_matches_reference(backend, kind, n_max):
    parents, num_nodes = random_batch(3, n_max, seed=n_max + 1, kind=kind)
    lens = torch.tensor([0, 5, 13], dtype=torch.int64)
    indptr = flashinfer.mask_indptr(n_max, lens)
    total = int(indptr[-1])
    bits, _ = reference.tree_ancestor_bits(parents, num_nodes)
    got = backend.ops.packed_tree_mask(*backend.put(bits, lens, indptr), total).cpu()
    expected = reference.packed_tree_mask(bits, lens, indptr, total)
    assert got.dtype == torch.uint8 and torch.equal(got, expected)
    anc = reference.ancestor_matrix(parents, num_nodes)
    for b, mask in enumerate(unpack_flashinfer(got, indptr, n_max, lens.tolist())):
        assert mask[:, :int(lens[b])].all() and torch.equal(mask[:, int(lens[b]):], anc[b])


def test_packed_custom_mask_from_a_tree():
    tree = make_tree(HAND_PARENTS, HAND_NUM_NODES)
    packed, indptr = flashinfer.packed_custom_mask(tree, torch.tensor([3]))
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, (8 * 11 + 7) // 8]
    mask = unpack_flashinfer(packed, indptr, 8, [3])[0]
    assert mask[6].tolist() == [True] * 3 + [True, True, False, False, True, False, True, False]
    again, _ = flashinfer.packed_custom_mask(tree, torch.tensor([3]), total_bytes=11)
    assert torch.equal(packed, again)


def test_packed_tree_mask_bad_input():
    bits, _ = reference.tree_ancestor_bits(*random_batch(2, 9, seed=0))
    lens = torch.tensor([4, 2], dtype=torch.int64)
    indptr = flashinfer.mask_indptr(9, lens)
    total = int(indptr[-1])
    with pytest.raises(ValueError, match="total_bytes"):
        ops.packed_tree_mask(bits, lens, indptr, total + 1)
    bad = indptr.clone()
    bad[1] += 1
    with pytest.raises(ValueError, match="ceil"):
        ops.packed_tree_mask(bits, lens, bad, total)
    with pytest.raises(ValueError, match="sequence length"):
        ops.packed_tree_mask(bits, torch.tensor([-1, 2]), indptr, total)
    with pytest.raises(RuntimeError, match="seq_lens must be Long"):  # int64 at the op level
        ops.packed_tree_mask(bits, lens.int(), indptr, total)
    with pytest.raises(RuntimeError, match="shape"):
        ops.packed_tree_mask(bits[:, :, :0], lens, indptr, total)
