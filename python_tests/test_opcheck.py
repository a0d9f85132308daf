"""torch.library.opcheck on every op: schema, fake kernel, dispatch and autograd registration."""
from __future__ import annotations

import pytest
import torch

from conftest import cuda_available
from dartree_ext.testing import random_batch

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])


def _sample_args(name: str, device: str):
    parents, num_nodes = random_batch(3, 70, seed=11)
    parents, num_nodes = parents.to(device), num_nodes.to(device)
    if name in ("tree_ancestor_bits", "tree_links"):
        return (parents, num_nodes)
    if name == "packed_tree_mask":
        from dartree_ext.integrations.flashinfer import mask_indptr
        bits, _ = torch.ops.dartree_ext.tree_ancestor_bits(parents, num_nodes)
        lens = torch.tensor([0, 5, 9], device=device)
        indptr = mask_indptr(70, lens)
        return (bits, lens, indptr, int(indptr[-1]))
    if name == "tree_attention_mask":
        return (parents, num_nodes, torch.rand(3, 9, device=device) < 0.5, torch.bfloat16)
    if name == "verify_tree":
        tokens = torch.randint(0, 3, parents.shape, device=device)
        return (tokens, parents, num_nodes, torch.randint(0, 3, parents.shape, device=device))
    if name == "select_top_w":
        return (torch.randn(3, 12, device=device), torch.randn(3, 12, 64, device=device),
                torch.tensor([12, 3, 0], dtype=torch.int32, device=device), 12)
    if name == "select_top_b":
        return (parents, torch.randn(parents.shape, device=device), num_nodes, 16)
    if name == "compact_kv_":
        return (torch.randn(3, 2, 30, 8, device=device), torch.randn(3, 2, 30, 4, device=device),
                torch.tensor([[10, 12, 13], [5, 6, 0], [0, 0, 0]], device=device),
                torch.tensor([9, 4, 0], device=device), torch.tensor([3, 2, 0], dtype=torch.int32, device=device))
    if name == "compact_kv_layers_":
        caches = [torch.randn(3, 2, 30, 8, device=device), torch.randn(3, 1, 30, 4, device=device).half(),
                  torch.randn(3, 4, 30, 6, device=device).bfloat16()]
        return (caches, torch.tensor([[10, 12, 13], [5, 6, 0], [0, 0, 0]], device=device),
                torch.tensor([9, 4, 0], device=device), torch.tensor([3, 2, 0], dtype=torch.int32, device=device))
    if name == "compact_kv_paged_":
        pools = [torch.randn(7, 4, 2, 8, device=device), torch.randn(7, 4, 2, 6, device=device).half()]
        table = torch.tensor([[3, 0, 5], [1, 2, 6]], dtype=torch.int32, device=device)
        return (pools, table, torch.tensor([[5, 7, 9], [2, 0, 0]], device=device), torch.tensor([2, 1], device=device),
                torch.tensor([3, 1], dtype=torch.int32, device=device))
    if name in ("expand_depth", "build_supertree"):
        from dartree_ext.head import CorrectionHeadWeights
        head = CorrectionHeadWeights.random(30, 12, 8, 6, device=device)
        weights = (head.w_s, head.fc2_weight, head.fc2_bias, head.gru_table, head.w_hh, head.b_hh)
        ids = torch.stack([torch.randperm(30)[:5] for _ in range(3 * 4)]).view(3, 4, 5).to(device)
        base = torch.randn(3, 4, 5, device=device)
        z = torch.randn(3, 4, 8, device=device)
        if name == "build_supertree":
            return (z, ids, base, torch.randn(3, 6, device=device), *weights, [3, 4, 2, 3], -0.2)
        return (z[:, 0].contiguous(), ids[:, 0].contiguous(), base[:, 0].contiguous(),
                torch.randn(3, 2, 6, device=device), torch.randn(3, 2, device=device),
                torch.tensor([2, 1, 0], dtype=torch.int32, device=device), *weights, 4, -0.2)
    if name == "few_rows_attention":
        mask = torch.where(torch.rand(2, 1, 5, 11) < 0.7, 0.0, torch.finfo(torch.float32).min)
        return (torch.randn(2, 6, 5, 16), torch.randn(2, 3, 11, 16), torch.randn(2, 3, 11, 8), mask, 0.25)
    if name == "quant_linear":
        from dartree_ext.quant import quantize
        blocks = quantize(torch.randn(12, 64), "q4_1").to(device)
        return (torch.randn(5, 64, device=device), blocks, "q4_1", torch.randn(12, device=device))
    if name == "rms_norm_rows":
        return (torch.randn(2, 5, 24).bfloat16(), torch.randn(24).bfloat16(), 1e-5)
    if name == "tokens_from_logits":
        return (torch.randn(2, 3, 130).bfloat16(), torch.rand(2, 3, 1), 0.8)
    if name == "rotary_rows":
        return (torch.randn(2, 5, 3, 8).transpose(1, 2), torch.arange(5)[None].expand(2, -1), 10000.0)
    logprobs = torch.sort(torch.randn(3, 4, 8, device=device), dim=-1, descending=True).values
    return (logprobs, torch.randint(0, 100, (3, 4, 8), device=device), torch.arange(3, device=device), 20)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["tree_ancestor_bits", "tree_attention_mask", "tree_links", "packed_tree_mask",
                                  "verify_tree",
                                  "select_top_w", "select_top_b", "ddtree_heap", "expand_depth",
                                  "build_supertree", "compact_kv_", "compact_kv_layers_", "compact_kv_paged_",
                                  "few_rows_attention", "rms_norm_rows", "rotary_rows", "tokens_from_logits",
                                  "quant_linear"])
def test_opcheck(name, device):
    if name in ("few_rows_attention", "rms_norm_rows", "rotary_rows", "tokens_from_logits") and device != "cpu":
        pytest.skip("a CPU op")
    op = getattr(torch.ops.dartree_ext, name).default
    torch.library.opcheck(op, _sample_args(name, device))


def test_ops_compile_with_fullgraph():
    from dartree_ext import ops

    parents, num_nodes = random_batch(2, 20, seed=3)
    past = torch.ones(2, 4, dtype=torch.bool)

    def round_masks(parents, num_nodes, past):
        bits, depths = ops.tree_ancestor_bits(parents, num_nodes)
        return ops.tree_attention_mask(parents, num_nodes, past, torch.float16), depths + 1

    compiled = torch.compile(round_masks, fullgraph=True, backend="eager")
    expected = round_masks(parents, num_nodes, past)
    actual = compiled(parents, num_nodes, past)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
