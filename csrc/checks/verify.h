// Input checks of verify_tree.
#pragma once

#include "common.h"

namespace dartree {

// Shared by the CPU and CUDA entry points: everything but the tree values, which only the CPU
// checks (a CUDA op would have to synchronize).
inline void check_verify_inputs(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& num_nodes,
                                const at::Tensor& target_tokens) {
  const char* op = "verify_tree";
  check_tree(op, parents, num_nodes);
  check_tensor(op, "tokens", tokens, at::kLong, 2);
  check_tensor(op, "target_tokens", target_tokens, at::kLong, 2);
  check_same_device(op, "tokens", tokens, parents, "parents");
  check_same_device(op, "target_tokens", target_tokens, parents, "parents");
  check_shape(op, "tokens", tokens, parents.sizes());
  check_shape(op, "target_tokens", target_tokens, parents.sizes());
  if (!parents.device().is_cpu()) return;
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* target = target_tokens.data_ptr<int64_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < counts[b]; ++i) {
      TORCH_CHECK_VALUE(i == 0 || tok[b * n_max + i] >= 0, op, ": tokens[", b, ", ", i, "] = ", tok[b * n_max + i],
                        " is not a token id (negative)");
      TORCH_CHECK_VALUE(target[b * n_max + i] >= 0, op, ": target_tokens[", b, ", ", i, "] = ",
                        target[b * n_max + i], " is not a token id (negative)");
    }
}

}  // namespace dartree
