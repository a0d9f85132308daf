"""The expansion at the paper's head shape (E = G = 512, K = 64, W = 12) on every backend: the
CUDA kernels tile the head's weights and stage the parents' states in chunks (16 rows of 512
floats at a time), so only shapes this large exercise several chunks, several column blocks and
every warp of a block."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import reference
from dartree_ext.head import CorrectionHeadWeights

VOCAB, HIDDEN, E, G, K, W = 4096, 64, 512, 512, 64, 12


def inputs(batch, depth, dtype, seed=0, k=K, e=E, g=G):
    gen = torch.Generator().manual_seed(seed)
    head = CorrectionHeadWeights.random(VOCAB, HIDDEN, e, g, dtype=dtype, seed=seed, bias=True)
    z = torch.randn(batch, depth, e, generator=gen).to(dtype)
    cand_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(batch * depth)]).view(batch, depth, k)
    cand_base = (torch.randn(batch, depth, k, generator=gen) * 2).to(dtype)
    root_state = torch.randn(batch, g, generator=gen).to(dtype)
    return head, z, cand_ids, cand_base, root_state


def on(head, device):
    return CorrectionHeadWeights(**{f: None if getattr(head, f) is None else getattr(head, f).to(device)
                                    for f in head.__dataclass_fields__})


def assert_supertree_matches(backend, widths, head, z, cand_ids, cand_base, root_state):
    expected = reference.build_supertree(head, z, cand_ids, cand_base, root_state, widths, -0.2)
    actual = backend.ops.build_supertree(on(head, backend.device), *backend.put(z, cand_ids, cand_base, root_state),
                                         widths, -0.2)
    for a, e in zip(actual, expected):
        a = a.cpu()
        if a.is_floating_point():
            torch.testing.assert_close(a, e, atol=2e-4, rtol=1e-5)
        else:
            assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_supertree_at_the_paper_shape(backend, dtype):
    batch, depth = 3, 3  # 3 x 12 = 36 parent rows: three staged chunks per block
    assert_supertree_matches(backend, [W] * depth, *inputs(batch, depth, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, e, g", [(96, 80, 40), (160, 40, 300)])
def test_supertree_past_one_staging_batch(backend, dtype, k, e, g):
    """Shapes past what one batch of registers holds. K = 96 candidates: twelve warps' worth, so
    the CUDA logits kernel's last block is half empty; 12 parents x 96 = 1152 scores, so each
    warp's slice of the selection (144) runs past the entries its lanes hold in registers
    (4 x 32); E = 80 columns, not a multiple of the register batch (8 x 32). K = 160: the
    log-softmax's logits past the 128 its lanes hold; G = 300: a parent state copied to its
    children in two batches of loads, the second partial."""
    widths = [12, 12, 5]
    assert_supertree_matches(backend, widths, *inputs(2, len(widths), dtype, seed=4, k=k, e=e, g=g))


def test_expand_depth_at_the_paper_shape_with_bad_ids(backend):
    """One depth with 12 parents, a candidate id out of range in each request (scores -inf, reads
    nothing) and a request with fewer valid parents."""
    batch = 2
    head, z, cand_ids, cand_base, _ = inputs(batch, 1, torch.bfloat16, seed=1)
    cand_ids = cand_ids[:, 0].clone()
    cand_ids[0, 5] = VOCAB + 7
    cand_ids[1, 0] = -3
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(batch, W, G, generator=gen)
    scores = -torch.rand(batch, W, generator=gen)
    num = torch.tensor([W, 7], dtype=torch.int32)
    args = (z[:, 0].contiguous(), cand_ids, cand_base[:, 0].contiguous(), states, scores, num)
    if backend.name == "cpu":
        with pytest.raises(ValueError):
            backend.ops.expand_depth(on(head, backend.device), *backend.put(*args), W, -0.2)
        return
    ok, base = cand_ids.clone(), args[2].clone()  # the reference: a valid id whose logit is -inf
    ok[0, 5], ok[1, 0] = 0, 0
    base[0, 5], base[1, 0] = float("-inf"), float("-inf")
    expected = reference.expand_depth(head, args[0], ok, base, *args[3:], W, -0.2)
    actual = backend.ops.expand_depth(on(head, backend.device), *backend.put(*args), W, -0.2)
    parent_idx, child_k, child_scores, tokens, child_states = (t.cpu() for t in actual)
    # the bad candidates never win (they score -inf); everything else is the reference's
    assert not ((child_k[0] == 5).any() or (child_k[1] == 0).any())
    assert torch.equal(parent_idx, expected[0]) and torch.equal(tokens, expected[3])
    torch.testing.assert_close(child_scores, expected[2], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(child_states, expected[4], atol=2e-4, rtol=1e-5)


def test_cuda_shared_memory_limit_is_a_clear_error(backend):
    """The CUDA selection kernel's shared memory grows with the width W (18 W floats): past 48 KiB
    the op says so instead of failing to launch (the CPU has no such limit)."""
    if backend.name != "cuda":
        pytest.skip("a CUDA-only limit")
    head, z, cand_ids, cand_base, root_state = inputs(1, 2, torch.float32)
    with pytest.raises(ValueError, match="shared memory"):
        backend.ops.build_supertree(on(head, backend.device), *backend.put(z, cand_ids, cand_base, root_state),
                                    [12, 683], -0.2)
    backend.ops.build_supertree(on(head, backend.device), *backend.put(z, cand_ids, cand_base, root_state),
                                [12, 682], -0.2)  # 18 x 682 floats fit
