// CUDA ops for the selection ops: checks, device guard, outputs, current stream. Plain C++ (no nvcc):
// the kernels are compiled from csrc/kernels/select.cuh by csrc/cuda/select.cu, so torch's headers
// are parsed once per build rather than once per GPU arch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks/select.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_top_w_cuda(const at::Tensor& parent_scores,
                                                                  const at::Tensor& child_logprobs,
                                                                  const at::Tensor& num_parents, int64_t width) {
  check_select_top_w_inputs(parent_scores, child_logprobs, num_parents, width);
  const c10::cuda::CUDAGuard guard(parent_scores.device());
  const int64_t batch = parent_scores.size(0);
  at::Tensor parent_idx = at::empty({batch, width}, num_parents.options());
  at::Tensor child_k = at::empty({batch, width}, num_parents.options());
  at::Tensor scores = at::empty({batch, width}, parent_scores.options());
  kernels::launch_select_top_w(parent_scores.data_ptr<float>(), child_logprobs.data_ptr<float>(),
                               num_parents.data_ptr<int32_t>(), static_cast<int>(batch),
                               static_cast<int>(parent_scores.size(1)), static_cast<int>(child_logprobs.size(2)),
                               static_cast<int>(width), parent_idx.data_ptr<int32_t>(), child_k.data_ptr<int32_t>(),
                               scores.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {parent_idx, child_k, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_top_b_cuda(const at::Tensor& parents, const at::Tensor& scores,
                                                                  const at::Tensor& num_nodes, int64_t budget) {
  check_select_top_b_inputs(parents, scores, num_nodes, budget);
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t batch = parents.size(0);
  at::Tensor keep = at::empty({batch, budget + 1}, parents.options());
  at::Tensor new_parents = at::empty({batch, budget + 1}, parents.options());
  at::Tensor num_kept = at::empty({batch}, parents.options());
  kernels::launch_select_top_b(parents.data_ptr<int32_t>(), scores.data_ptr<float>(), num_nodes.data_ptr<int32_t>(),
                               static_cast<int>(batch), static_cast<int>(parents.size(1)), static_cast<int>(budget),
                               keep.data_ptr<int32_t>(), new_parents.data_ptr<int32_t>(), num_kept.data_ptr<int32_t>(),
                               at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {keep, new_parents, num_kept};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ddtree_heap_cuda(
    const at::Tensor& logprobs, const at::Tensor& token_ids, const at::Tensor& root_tokens, int64_t budget) {
  check_ddtree_heap_inputs(logprobs, token_ids, root_tokens, budget);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t batch = logprobs.size(0), slots = budget + 1;
  at::Tensor tokens = at::empty({batch, slots}, token_ids.options());
  at::Tensor parents = at::empty({batch, slots}, logprobs.options().dtype(at::kInt));
  at::Tensor depths = at::empty({batch, slots}, logprobs.options().dtype(at::kInt));
  at::Tensor scores = at::empty({batch, slots}, logprobs.options());
  at::Tensor num_nodes = at::empty({batch}, logprobs.options().dtype(at::kInt));
  kernels::launch_ddtree_heap(logprobs.data_ptr<float>(), token_ids.data_ptr<int64_t>(),
                              root_tokens.data_ptr<int64_t>(), static_cast<int>(batch),
                              static_cast<int>(logprobs.size(1)), static_cast<int>(logprobs.size(2)),
                              static_cast<int>(budget), tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
                              depths.data_ptr<int32_t>(), scores.data_ptr<float>(), num_nodes.data_ptr<int32_t>(),
                              at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, parents, depths, scores, num_nodes};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) {
  m.impl("select_top_w", &select_top_w_cuda);
  m.impl("select_top_b", &select_top_b_cuda);
  m.impl("ddtree_heap", &ddtree_heap_cuda);
}

}  // namespace dartree
