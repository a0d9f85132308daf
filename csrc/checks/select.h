// Input checks of the select ops: select_top_w, select_top_b and ddtree_heap.
#pragma once

#include <cstdint>

#include "common.h"

namespace dartree {

constexpr int64_t kMaxHeapBudget = kernels::kMaxHeapBudget;

inline void check_select_top_w_inputs(const at::Tensor& parent_scores, const at::Tensor& child_logprobs,
                                      const at::Tensor& num_parents, int64_t width) {
  const char* op = "select_top_w";
  check_tensor(op, "parent_scores", parent_scores, at::kFloat, 2);
  check_tensor(op, "child_logprobs", child_logprobs, at::kFloat, 3);
  check_tensor(op, "num_parents", num_parents, at::kInt, 1);
  check_same_device(op, "child_logprobs", child_logprobs, parent_scores, "parent_scores");
  check_same_device(op, "num_parents", num_parents, parent_scores, "parent_scores");
  const int64_t batch = parent_scores.size(0), p_max = parent_scores.size(1);
  TORCH_CHECK(child_logprobs.size(0) == batch && child_logprobs.size(1) == p_max, op,
              ": child_logprobs must have shape [B, P, K] with [B, P] = ", parent_scores.sizes(), ", got ",
              child_logprobs.sizes());
  check_shape(op, "num_parents", num_parents, {batch});
  TORCH_CHECK_VALUE(child_logprobs.size(2) >= 1, op, ": child_logprobs needs K >= 1 candidates (dim 2)");
  TORCH_CHECK_VALUE(p_max * child_logprobs.size(2) < (int64_t{1} << 31), op, ": P * K must be below 2^31");
  TORCH_CHECK_VALUE(width >= 1 && width <= kMaxTreeNodes, op, ": width must be in [1, ", kMaxTreeNodes,
                    "] (a tree holds at most ", kMaxTreeNodes, " nodes), got ", width);
}

inline void check_select_top_b_inputs(const at::Tensor& parents, const at::Tensor& scores,
                                      const at::Tensor& num_nodes, int64_t budget) {
  const char* op = "select_top_b";
  check_tree(op, parents, num_nodes);
  check_tensor(op, "scores", scores, at::kFloat, 2);
  check_same_device(op, "scores", scores, parents, "parents");
  check_shape(op, "scores", scores, parents.sizes());
  TORCH_CHECK_VALUE(budget >= 0 && budget <= kMaxTreeNodes, op, ": budget must be in [0, ", kMaxTreeNodes,
                    "] (a tree holds at most ", kMaxTreeNodes, " nodes), got ", budget);
}

inline void check_ddtree_heap_inputs(const at::Tensor& logprobs, const at::Tensor& token_ids,
                                     const at::Tensor& root_tokens, int64_t budget) {
  const char* op = "ddtree_heap";
  check_tensor(op, "logprobs", logprobs, at::kFloat, 3);
  check_tensor(op, "token_ids", token_ids, at::kLong, 3);
  check_tensor(op, "root_tokens", root_tokens, at::kLong, 1);
  check_same_device(op, "token_ids", token_ids, logprobs, "logprobs");
  check_same_device(op, "root_tokens", root_tokens, logprobs, "logprobs");
  check_shape(op, "token_ids", token_ids, logprobs.sizes());
  check_shape(op, "root_tokens", root_tokens, {logprobs.size(0)});
  TORCH_CHECK_VALUE(logprobs.size(1) <= 32767, op, ": at most 32767 draft positions (dim 1), got ", logprobs.size(1));
  TORCH_CHECK_VALUE(logprobs.size(2) <= 65536, op, ": at most 65536 candidates per position (dim 2), got ",
                    logprobs.size(2));
  TORCH_CHECK_VALUE(budget >= 0 && budget <= kMaxHeapBudget, op, ": budget must be in [0, ", kMaxHeapBudget,
                    "], got ", budget);
}

}  // namespace dartree
