// CUDA ops for the tree verification walk: checks, device guard, outputs, current stream. Plain C++ (no nvcc):
// the kernels are compiled from csrc/kernels/verify.cuh by csrc/cuda/verify.cu, so torch's headers
// are parsed once per build rather than once per GPU arch.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks/verify.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cuda(const at::Tensor& tokens, const at::Tensor& parents,
                                                                const at::Tensor& num_nodes,
                                                                const at::Tensor& target_tokens) {
  check_verify_inputs(tokens, parents, num_nodes, target_tokens);
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t batch = parents.size(0);
  at::Tensor accept_nodes = at::empty_like(parents);
  at::Tensor accept_len = at::empty({batch}, parents.options());
  at::Tensor bonus = at::empty({batch}, tokens.options());
  kernels::launch_verify_tree(tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), num_nodes.data_ptr<int32_t>(),
                              target_tokens.data_ptr<int64_t>(), static_cast<int>(batch),
                              static_cast<int>(parents.size(1)), accept_nodes.data_ptr<int32_t>(),
                              accept_len.data_ptr<int32_t>(), bonus.data_ptr<int64_t>(),
                              at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_nodes, accept_len, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) { m.impl("verify_tree", &verify_tree_cuda); }

}  // namespace dartree
