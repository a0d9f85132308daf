// CUDA ops for the tree-structure ops: checks, device guard, outputs, current stream. Plain C++ (no nvcc):
// the kernels are compiled from csrc/kernels/tree_mask.cuh by csrc/cuda/tree_mask.cu, so torch's headers
// are parsed once per build rather than once per GPU arch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks/tree_mask.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

std::tuple<at::Tensor, at::Tensor> tree_ancestor_bits_cuda(const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree("tree_ancestor_bits", parents, num_nodes);
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  at::Tensor bits = at::empty({batch, n_max, (n_max + 63) / 64}, parents.options().dtype(at::kLong));
  at::Tensor depths = at::empty({batch, n_max}, parents.options());
  kernels::launch_tree_ancestor_bits(parents.data_ptr<int32_t>(), num_nodes.data_ptr<int32_t>(),
                                     static_cast<int>(batch), static_cast<int>(n_max),
                                     reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()), depths.data_ptr<int32_t>(),
                                     at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {bits, depths};
}

at::Tensor tree_attention_mask_cuda(const at::Tensor& parents, const at::Tensor& num_nodes,
                                    const at::Tensor& past_key_mask, at::ScalarType dtype) {
  check_attention_mask_inputs(parents, num_nodes, past_key_mask, dtype);
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t batch = parents.size(0), n_max = parents.size(1), past = past_key_mask.size(1);
  TORCH_CHECK(past <= std::numeric_limits<int>::max() - n_max, "tree_attention_mask: past_key_mask is too long: ", past);
  at::Tensor out = at::empty({batch, 1, n_max, past + n_max}, parents.options().dtype(dtype));
  const uint64_t hidden = lowest_value_bits(dtype);
  const auto* pkm = reinterpret_cast<const uint8_t*>(past_key_mask.data_ptr<bool>());
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  kernels::launch_tree_attention_mask(par, counts, pkm, static_cast<int>(batch), static_cast<int>(n_max),
                                      static_cast<int>(past), static_cast<int>(at::elementSize(dtype)), hidden,
                                      out.data_ptr(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> tree_links_cuda(const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree("tree_links", parents, num_nodes);
  const c10::cuda::CUDAGuard guard(parents.device());
  at::Tensor next_token = at::empty_like(parents);
  at::Tensor next_sibling = at::empty_like(parents);
  kernels::launch_tree_links(parents.data_ptr<int32_t>(), num_nodes.data_ptr<int32_t>(),
                             static_cast<int>(parents.size(0)), static_cast<int>(parents.size(1)),
                             next_token.data_ptr<int32_t>(), next_sibling.data_ptr<int32_t>(),
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {next_token, next_sibling};
}

at::Tensor packed_tree_mask_cuda(const at::Tensor& bits, const at::Tensor& seq_lens, const at::Tensor& mask_indptr,
                                 int64_t total_bytes) {
  check_packed_tree_mask_inputs(bits, seq_lens, mask_indptr, total_bytes);
  const c10::cuda::CUDAGuard guard(bits.device());
  at::Tensor out = at::empty({total_bytes}, bits.options().dtype(at::kByte));
  kernels::launch_packed_tree_mask(reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>()),
                                   seq_lens.data_ptr<int64_t>(), mask_indptr.data_ptr<int32_t>(),
                                   static_cast<int>(bits.size(0)), static_cast<int>(bits.size(1)), total_bytes,
                                   out.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) {
  m.impl("packed_tree_mask", &packed_tree_mask_cuda);
  m.impl("tree_ancestor_bits", &tree_ancestor_bits_cuda);
  m.impl("tree_attention_mask", &tree_attention_mask_cuda);
  m.impl("tree_links", &tree_links_cuda);
}

}  // namespace dartree
