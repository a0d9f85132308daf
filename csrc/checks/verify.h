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
}

}  // namespace dartree
