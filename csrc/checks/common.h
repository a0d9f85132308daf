// Host-side input checks shared by the CPU and CUDA implementations of every area: validation
// with messages that name the op, the argument and what was expected. The checks of one area's
// ops live in csrc/checks/<area>.h, which include this header.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "../kernels/launchers.h"

namespace dartree {

constexpr int64_t kMaxTreeNodes = kernels::kMaxNodes;

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference,
                              const char* reference_name) {
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " is on ", t.device(), " but ", reference_name,
              " is on ", reference.device(), "; all inputs must be on one device");
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ", t.sizes());
}

// dtype, shape and device of a tree (parents int32[B, N], num_nodes int32[B]); cheap, no sync.
inline void check_tree_layout(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tensor(op, "parents", parents, at::kInt, 2);
  check_tensor(op, "num_nodes", num_nodes, at::kInt, 1);
  check_same_device(op, "num_nodes", num_nodes, parents, "parents");
  const int64_t n = parents.size(1);
  TORCH_CHECK_VALUE(n >= 1 && n <= kMaxTreeNodes, op, ": parents must have 1..", kMaxTreeNodes,
                    " nodes per request (dim 1), got ", n);
  check_shape(op, "num_nodes", num_nodes, {parents.size(0)});
  TORCH_CHECK_VALUE(!parents.is_cuda() || parents.size(0) <= 65535, op,
                    ": CUDA kernels take at most 65535 requests per call, got ", parents.size(0));
}

// The values of a tree on the CPU: 1 <= num_nodes[b] <= N and 0 <= parents[b, i] < i for every
// valid non-root node. The root's entry and padding entries are not read.
inline void check_tree_values_cpu(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts[b];
    TORCH_CHECK_VALUE(n >= 1 && n <= n_max, op, ": num_nodes[", b, "] = ", n, " is outside [1, ", n_max, "]");
    for (int64_t i = 1; i < n; ++i) {
      const int64_t p = par[b * n_max + i];
      TORCH_CHECK_VALUE(p >= 0 && p < i, op, ": parents[", b, ", ", i, "] = ", p,
                        " breaks the tree layout; expected 0 <= parent < ", i,
                        " (nodes in topological order, parent before child)");
    }
  }
}

inline void check_tree(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree_layout(op, parents, num_nodes);
  if (parents.device().is_cpu()) check_tree_values_cpu(op, parents, num_nodes);
}

// Bit pattern of finfo(dtype).min, the additive mask's "hidden" value, widened to 64 bits.
inline uint64_t lowest_value_bits(at::ScalarType dtype) {
  uint64_t bits = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "lowest_value_bits", [&] {
    const scalar_t lowest = std::numeric_limits<scalar_t>::lowest();
    std::memcpy(&bits, &lowest, sizeof(scalar_t));
  });
  return bits;
}

}  // namespace dartree
