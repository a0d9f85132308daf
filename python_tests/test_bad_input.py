"""Bad input raises an error that names the argument and the expectation: one test per case.
Value checks (topology, num_nodes range) run in the CPU kernels, and on CUDA with validate=True."""
from __future__ import annotations


import pytest
import torch

import dartree_ext
from dartree_ext import ops
from dartree_ext.testing import HAND_NUM_NODES, HAND_PARENTS, HAND_TOKENS
from conftest import cuda_available

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])
TREE_OPS = {
    "tree_ancestor_bits": lambda p, n: ops.tree_ancestor_bits(p, n, validate=True),
    "tree_links": lambda p, n: ops.tree_links(p, n, validate=True),
    "tree_attention_mask": lambda p, n: ops.tree_attention_mask(
        p, n, torch.ones(p.shape[0], 2, dtype=torch.bool, device=p.device), validate=True),
    "verify_tree": lambda p, n: ops.verify_tree(
        torch.zeros(p.shape, dtype=torch.int64, device=p.device), p, n,
        torch.zeros(p.shape, dtype=torch.int64, device=p.device), validate=True),
}


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=sorted(TREE_OPS))
def tree_op(request):
    return TREE_OPS[request.param]


def test_parent_not_topological(tree_op, device):
    parents = HAND_PARENTS.clone()
    parents[0, 3] = 5  # a parent after its child
    with pytest.raises(ValueError, match=r"parents\[0, 3\] = 5 .*0 <= parent < 3"):
        tree_op(parents.to(device), HAND_NUM_NODES.to(device))


def test_parent_out_of_range(tree_op, device):
    parents = HAND_PARENTS.clone()
    parents[0, 2] = -4
    with pytest.raises(ValueError, match=r"parents\[0, 2\] = -4"):
        tree_op(parents.to(device), HAND_NUM_NODES.to(device))


def test_self_parent(tree_op, device):
    parents = HAND_PARENTS.clone()
    parents[0, 4] = 4
    with pytest.raises(ValueError, match=r"parents\[0, 4\] = 4"):
        tree_op(parents.to(device), HAND_NUM_NODES.to(device))


@pytest.mark.parametrize("count", [0, -1, 9])
def test_num_nodes_outside_range(tree_op, device, count):
    with pytest.raises(ValueError, match=rf"num_nodes\[0\] = {count} is outside \[1, 8\]"):
        tree_op(HAND_PARENTS.to(device), torch.tensor([count], dtype=torch.int32, device=device))


def test_parents_wrong_dtype(tree_op, device):
    with pytest.raises(RuntimeError, match="parents must be Int"):
        tree_op(HAND_PARENTS.long().to(device), HAND_NUM_NODES.to(device))


def test_num_nodes_wrong_dtype(tree_op, device):
    with pytest.raises(RuntimeError, match="num_nodes must be Int"):
        tree_op(HAND_PARENTS.to(device), HAND_NUM_NODES.long().to(device))


def test_num_nodes_wrong_batch(tree_op, device):
    with pytest.raises(RuntimeError, match=r"num_nodes must have shape \[1\]"):
        tree_op(HAND_PARENTS.to(device), torch.tensor([7, 7], dtype=torch.int32, device=device))


def test_parents_not_contiguous(tree_op, device):
    parents = torch.full((8, 8), -1, dtype=torch.int32, device=device).t()
    with pytest.raises(RuntimeError, match="parents must be contiguous"):
        tree_op(parents, torch.ones(8, dtype=torch.int32, device=device))


def test_parents_wrong_rank(tree_op, device):
    with pytest.raises(RuntimeError, match="parents must be 2-D"):
        tree_op(HAND_PARENTS[0].to(device), HAND_NUM_NODES.to(device))


def test_too_many_nodes(tree_op, device):
    n = ops.MAX_TREE_NODES + 1
    parents = torch.full((1, n), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"1..{ops.MAX_TREE_NODES} nodes per request"):
        tree_op(parents, torch.ones(1, dtype=torch.int32, device=device))


def test_max_nodes_matches_build():
    assert dartree_ext.build_info()["max_tree_nodes"] == ops.MAX_TREE_NODES


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_device_mix():
    with pytest.raises(RuntimeError, match="num_nodes is on cpu but parents is on cuda"):
        ops.tree_links(HAND_PARENTS.cuda(), HAND_NUM_NODES)


def test_device_mix_is_caught_while_tracing():
    with pytest.raises(RuntimeError, match="num_nodes is on meta but parents is on cpu"):
        ops.tree_links(HAND_PARENTS, HAND_NUM_NODES.to("meta"))


def test_mask_past_key_mask_wrong_dtype(device):
    with pytest.raises(RuntimeError, match="past_key_mask must be Bool"):
        ops.tree_attention_mask(HAND_PARENTS.to(device), HAND_NUM_NODES.to(device),
                                torch.ones(1, 4, dtype=torch.int32, device=device))


def test_mask_past_key_mask_wrong_batch(device):
    with pytest.raises(RuntimeError, match="past_key_mask must have batch size 1"):
        ops.tree_attention_mask(HAND_PARENTS.to(device), HAND_NUM_NODES.to(device),
                                torch.ones(2, 4, dtype=torch.bool, device=device))


def test_mask_integer_dtype(device):
    with pytest.raises(RuntimeError, match="dtype must be float32, float16, bfloat16 or float64"):
        ops.tree_attention_mask(HAND_PARENTS.to(device), HAND_NUM_NODES.to(device),
                                torch.ones(1, 4, dtype=torch.bool, device=device), torch.int32)


def test_verify_tokens_wrong_dtype(device):
    with pytest.raises(RuntimeError, match="tokens must be Long"):
        ops.verify_tree(HAND_TOKENS.int().to(device), HAND_PARENTS.to(device), HAND_NUM_NODES.to(device),
                        HAND_TOKENS.to(device))


def test_verify_target_wrong_shape(device):
    with pytest.raises(RuntimeError, match=r"target_tokens must have shape \[1, 8\]"):
        ops.verify_tree(HAND_TOKENS.to(device), HAND_PARENTS.to(device), HAND_NUM_NODES.to(device),
                        HAND_TOKENS[:, :4].contiguous().to(device))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be finite and >= 0"),
    ({"temperature": 1.0, "top_k": 0}, "top_k must be >= 1"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
])
def test_sampling_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dartree_ext.target_tokens_from_logits(torch.zeros(2, 5), **kwargs)


# selection ops ---------------------------------------------------------------------------------

def test_select_top_w_negative_width(device):
    with pytest.raises(ValueError, match=r"width must be in \[1, 8192\]"):
        ops.select_top_w(torch.zeros(1, 2, device=device), torch.zeros(1, 2, 3, device=device),
                         torch.tensor([2], dtype=torch.int32, device=device), -1)


def test_select_top_w_num_parents_out_of_range(device):
    with pytest.raises(ValueError, match=r"num_parents\[0\] = 3 is outside \[0, 2\]"):
        ops.select_top_w(torch.zeros(1, 2, device=device), torch.zeros(1, 2, 3, device=device),
                         torch.tensor([3], dtype=torch.int32, device=device), 1, validate=True)


def test_select_top_w_shape_mismatch(device):
    with pytest.raises(RuntimeError, match=r"child_logprobs must have shape \[B, P, K\]"):
        ops.select_top_w(torch.zeros(1, 2, device=device), torch.zeros(1, 3, 3, device=device),
                         torch.tensor([2], dtype=torch.int32, device=device), 1)


def test_select_top_b_negative_budget(device):
    with pytest.raises(ValueError, match="budget must be in"):
        ops.select_top_b(HAND_PARENTS.to(device), torch.zeros(1, 8, device=device), HAND_NUM_NODES.to(device), -1)


def test_select_top_b_non_topological(device):
    parents = HAND_PARENTS.clone()
    parents[0, 5] = 6
    with pytest.raises(ValueError, match=r"parents\[0, 5\] = 6"):
        ops.select_top_b(parents.to(device), torch.zeros(1, 8, device=device), HAND_NUM_NODES.to(device), 3,
                         validate=True)


def test_select_top_b_scores_wrong_dtype(device):
    with pytest.raises(RuntimeError, match="scores must be Float"):
        ops.select_top_b(HAND_PARENTS.to(device), torch.zeros(1, 8, dtype=torch.float64, device=device),
                         HAND_NUM_NODES.to(device), 3)


def test_ddtree_heap_unsorted_logprobs(device):
    logprobs = torch.tensor([[[-1.0, -0.5, -2.0]]], device=device)
    with pytest.raises(ValueError, match=r"logprobs\[0, 0\] must be sorted in descending order"):
        ops.ddtree_heap(logprobs, torch.zeros(1, 1, 3, dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int64, device=device), 4, validate=True)


def test_ddtree_heap_nan_logprobs(device):
    logprobs = torch.tensor([[[-1.0, float("nan")]]], device=device)
    with pytest.raises(ValueError, match="free of NaN"):
        ops.ddtree_heap(logprobs, torch.zeros(1, 1, 2, dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int64, device=device), 4, validate=True)


@pytest.mark.parametrize("budget", [-1, ops.MAX_HEAP_BUDGET + 1])
def test_ddtree_heap_budget_out_of_range(device, budget):
    with pytest.raises(ValueError, match=rf"budget must be in \[0, {ops.MAX_HEAP_BUDGET}\]"):
        ops.ddtree_heap(torch.zeros(1, 2, 3, device=device), torch.zeros(1, 2, 3, dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int64, device=device), budget)


def test_max_heap_budget_matches_build():
    assert dartree_ext.build_info()["max_heap_budget"] == ops.MAX_HEAP_BUDGET


# expand ops ------------------------------------------------------------------------------------

def _expand_args(device, dtype=torch.float32):
    from dartree_ext.head import CorrectionHeadWeights
    head = CorrectionHeadWeights.random(30, 12, 8, 6, device=device, dtype=dtype)
    z = torch.randn(2, 3, 8, device=device, dtype=dtype)
    ids = torch.randint(0, 30, (2, 3, 5), device=device)
    base = torch.randn(2, 3, 5, device=device, dtype=dtype)
    root = torch.randn(2, 6, device=device, dtype=dtype)
    return head, z, ids, base, root


def test_build_supertree_wrong_width_count(device):
    head, z, ids, base, root = _expand_args(device)
    with pytest.raises(ValueError, match=r"widths must give one width per depth \(3\), got 2"):
        ops.build_supertree(head, z, ids, base, root, [4, 4])


def test_build_supertree_zero_width(device):
    head, z, ids, base, root = _expand_args(device)
    with pytest.raises(ValueError, match=r"every width must be in \[1, 65535\]"):
        ops.build_supertree(head, z, ids, base, root, 0)


def test_build_supertree_dtype_mismatch(device):
    head, z, ids, base, root = _expand_args(device)
    with pytest.raises(RuntimeError, match="z must be Float, got BFloat16"):
        ops.build_supertree(head, z.bfloat16(), ids, base, root, 2)


def test_build_supertree_double_weights(device):
    head, z, ids, base, root = _expand_args(device, torch.float64)
    with pytest.raises(RuntimeError, match="weights must be float32, bfloat16 or float16"):
        ops.build_supertree(head, z, ids, base, root, 2)


def test_build_supertree_fc2_vocab_mismatch(device):
    head, z, ids, base, root = _expand_args(device)
    head.fc2_bias = head.fc2_bias[:-1].contiguous()
    with pytest.raises(RuntimeError, match=r"fc2_bias must have shape \[30\]"):
        ops.build_supertree(head, z, ids, base, root, 2)


def test_expand_depth_num_parents_out_of_range():
    head, z, ids, base, _ = _expand_args("cpu")
    with pytest.raises(ValueError, match=r"num_parents\[1\] = 3 is outside \[0, 2\]"):
        ops.expand_depth(head, z[:, 0].contiguous(), ids[:, 0].contiguous(), base[:, 0].contiguous(),
                         torch.zeros(2, 2, 6), torch.zeros(2, 2), torch.tensor([1, 3], dtype=torch.int32), 2)


def test_expand_depth_states_wrong_size(device):
    head, z, ids, base, _ = _expand_args(device)
    with pytest.raises(RuntimeError, match=r"parent_states must be float32 \[B, P, G\]"):
        ops.expand_depth(head, z[:, 0].contiguous(), ids[:, 0].contiguous(), base[:, 0].contiguous(),
                         torch.zeros(2, 2, 7, device=device), torch.zeros(2, 2, device=device),
                         torch.ones(2, dtype=torch.int32, device=device), 2)


# kv area ---------------------------------------------------------------------------------------

def _kv(device, seq=10):
    return (torch.zeros(2, 1, seq, 4, device=device), torch.zeros(2, 1, seq, 4, device=device))


def test_compact_kv_positions_not_increasing():
    keys, values = _kv("cpu")
    with pytest.raises(ValueError, match=r"src_positions\[0, 1\] = 4 must be in \[6, 10\)"):
        ops.compact_kv_(keys, values, torch.tensor([[5, 4], [3, 4]]), torch.tensor([2, 2]),
                        torch.tensor([2, 2], dtype=torch.int32))


def test_compact_kv_source_before_destination():
    keys, values = _kv("cpu")
    with pytest.raises(ValueError, match=r"src_positions\[1, 0\] = 1 must be in \[2, 10\)"):
        ops.compact_kv_(keys, values, torch.tensor([[5, 6], [1, 4]]), torch.tensor([2, 2]),
                        torch.tensor([2, 2], dtype=torch.int32))


def test_compact_kv_does_not_fit():
    keys, values = _kv("cpu")
    with pytest.raises(ValueError, match=r"dst_start\[0\] = 9 with 2 entries does not fit"):
        ops.compact_kv_(keys, values, torch.tensor([[9, 9], [3, 4]]), torch.tensor([9, 2]),
                        torch.tensor([2, 2], dtype=torch.int32))


def test_compact_kv_length_out_of_range():
    keys, values = _kv("cpu")
    with pytest.raises(ValueError, match=r"lengths\[1\] = 3 is outside \[0, 2\]"):
        ops.compact_kv_(keys, values, torch.tensor([[5, 6], [3, 4]]), torch.tensor([2, 2]),
                        torch.tensor([2, 3], dtype=torch.int32))


def test_compact_kv_wrong_dtypes(device):
    keys, values = _kv(device)
    with pytest.raises(RuntimeError, match="src_positions must be Long"):
        ops.compact_kv_(keys, values, torch.tensor([[5, 6], [3, 4]], dtype=torch.int32, device=device),
                        torch.tensor([2, 2], device=device), torch.tensor([2, 2], dtype=torch.int32, device=device))


def test_compact_kv_cache_not_contiguous(device):
    keys, values = _kv(device)
    with pytest.raises(RuntimeError, match="keys must be contiguous"):
        ops.compact_kv_(keys.transpose(2, 3).contiguous().transpose(2, 3), values,
                        torch.tensor([[5, 6], [3, 4]], device=device), torch.tensor([2, 2], device=device),
                        torch.tensor([2, 2], dtype=torch.int32, device=device))


def test_select_top_w_width_zero(device):
    with pytest.raises(ValueError, match=r"width must be in \[1, 8192\]"):
        ops.select_top_w(torch.zeros(1, 2, device=device), torch.zeros(1, 2, 3, device=device),
                         torch.ones(1, dtype=torch.int32, device=device), 0)


def test_compact_kv_keys_and_values_disagree(device):
    keys = torch.zeros(1, 2, 8, 4, device=device)
    values = torch.zeros(1, 3, 8, 4, device=device)  # another head count
    with pytest.raises(ValueError, match=r"must agree on \[B, H, S\]"):
        ops.compact_kv_(keys, values, torch.zeros(1, 1, dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int32, device=device))
    ops.compact_kv_(keys, torch.zeros(1, 2, 8, 6, device=device), torch.zeros(1, 1, dtype=torch.int64, device=device),
                    torch.zeros(1, dtype=torch.int64, device=device),
                    torch.ones(1, dtype=torch.int32, device=device))  # head dims may differ


# sizes past their bounds, refused before anything is allocated (in a child process): the
# "oversize" cases of test_bad_input_matrix.py

# token ids, non-finite scores, dtypes ------------------------------------------------------------




@pytest.mark.parametrize("name", ["tokens", "target_tokens"])
def test_verify_tree_negative_token_ids(device, name):
    parents, num_nodes = HAND_PARENTS.to(device), HAND_NUM_NODES.to(device)
    tokens, target = HAND_TOKENS.clone().to(device), HAND_TOKENS.clone().to(device)
    (tokens if name == "tokens" else target)[0, 2] = -3
    with pytest.raises(ValueError, match=rf"verify_tree: {name}\[0, 2\] = -3 is not a token id \(negative\)"):
        ops.verify_tree(tokens, parents, num_nodes, target)


def _heap_inputs(device):
    logprobs = torch.sort(torch.log_softmax(torch.randn(2, 3, 4), -1), -1, descending=True).values
    return logprobs.to(device), torch.randint(0, 9, (2, 3, 4), device=device), torch.tensor([1, 2], device=device)


def test_ddtree_heap_negative_ids_and_inf(device):
    logprobs, ids, roots = _heap_inputs(device)
    ids[1, 2, 3] = -1
    with pytest.raises(ValueError, match=r"ddtree_heap: token_ids\[1, 2, 3\] = -1 is not a token id"):
        ops.ddtree_heap(logprobs, ids, roots, 8)
    logprobs, ids, roots = _heap_inputs(device)
    roots[0] = -5
    with pytest.raises(ValueError, match=r"ddtree_heap: root_tokens\[0\] = -5 is not a token id"):
        ops.ddtree_heap(logprobs, ids, roots, 8)
    logprobs, ids, roots = _heap_inputs(device)
    logprobs[0, 1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"ddtree_heap: logprobs\[0, 1, 0\] = inf is not a log-probability"):
        ops.ddtree_heap(logprobs, ids, roots, 8)


def test_select_top_w_nan_scores(device):
    ps, cl = torch.zeros(2, 3, device=device), torch.log_softmax(torch.randn(2, 3, 4), -1).to(device)
    num = torch.tensor([3, 2], dtype=torch.int32, device=device)
    cl[1, 2, 0] = float("nan")  # a parent past num_parents[1]: never read, not refused
    ops.select_top_w(ps, cl, num, 2)
    cl[1, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"select_top_w: child_logprobs\[1, 1, 3\] is NaN"):
        ops.select_top_w(ps, cl, num, 2)
    ps[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"select_top_w: parent_scores\[0, 0\] is NaN"):
        ops.select_top_w(ps, cl, num, 2)
    ops.select_top_w(ps, cl, num, 2, validate=False)  # the loop's call: NaN ranks as -inf


def test_select_top_b_nan_scores(device):
    scores = torch.zeros(HAND_PARENTS.shape, device=device)
    scores[0, 4] = float("nan")
    with pytest.raises(ValueError, match=r"select_top_b: scores\[0, 4\] is NaN"):
        ops.select_top_b(HAND_PARENTS.to(device), scores, HAND_NUM_NODES.to(device), 3)


def test_expansion_nan_scores_and_candidates(device):
    head, z, ids, base, root = _expand_args(device)
    base[1, 2, 4] = float("nan")
    with pytest.raises(ValueError, match=r"build_supertree: cand_base\[1, 2, 4\] is NaN"):
        ops.build_supertree(head, z, ids, base, root, 2)
    head, z, ids, base, _ = _expand_args(device)
    scores = torch.zeros(2, 2, device=device)
    scores[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"expand_depth: parent_scores\[0, 1\] is NaN"):
        ops.expand_depth(head, z[:, 0].contiguous(), ids[:, 0].contiguous(), base[:, 0].contiguous(),
                         torch.zeros(2, 2, 6, device=device), scores, torch.full((2,), 2, dtype=torch.int32, device=device), 2)
    head, z, ids, base, root = _expand_args(device)
    ids[0, 1, 2] = 30  # the head's vocabulary is 30
    with pytest.raises(ValueError, match=r"cand_ids.*30"):
        ops.build_supertree(head, z, ids, base, root, 2)


def test_compact_kv_mixed_dtypes(device):
    keys, values = torch.zeros(2, 1, 10, 4, device=device), torch.zeros(2, 1, 10, 4, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"compact_kv_: keys \(Float\) and values \(BFloat16\) must have one dtype"):
        ops.compact_kv_(keys, values, torch.tensor([[5, 6], [3, 4]], device=device), torch.tensor([2, 2], device=device),
                        torch.tensor([2, 2], dtype=torch.int32, device=device))
