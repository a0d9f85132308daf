// CUDA ops of the VAT loss: checks, device guard, outputs, current stream. Plain C++ (no nvcc): the
// kernels are compiled from csrc/kernels/vat.cuh by csrc/cuda/vat.cu. Nothing here synchronizes.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../checks/vat.h"

namespace dartree {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> vat_row_forward_cuda(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const std::optional<at::Tensor>& uniforms,
    double temperature) {
  check_vat_row_forward_inputs(draft, target, tokens, uniforms, temperature);
  const c10::cuda::CUDAGuard guard(draft.device());
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  const auto stat = draft.options().dtype(vat_stat_dtype(draft.scalar_type()));
  at::Tensor ce_soft = at::empty({rows}, stat), ce_hard = at::empty({rows}, stat);
  at::Tensor draft_lse = at::empty({rows}, stat), target_lse = at::empty({rows}, stat);
  at::Tensor accept = at::empty({rows}, draft.options().dtype(at::kFloat));
  kernels::launch_vat_row_forward(vat_elem("vat_row_forward", "draft_logits", draft.scalar_type()), draft.data_ptr(),
                                  target.data_ptr(), tokens.data_ptr<int64_t>(),
                                  uniforms.has_value() ? uniforms->data_ptr<float>() : nullptr, rows, vocab,
                                  temperature, ce_soft.data_ptr(), ce_hard.data_ptr(), draft_lse.data_ptr(),
                                  target_lse.data_ptr(), accept.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ce_soft, ce_hard, accept, draft_lse, target_lse};
}

at::Tensor vat_row_backward_cuda(const at::Tensor& g_q, const at::Tensor& g_p, const at::Tensor& g_y,
                                 const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,
                                 const at::Tensor& draft_lse, const at::Tensor& target_lse) {
  check_vat_row_backward_inputs(g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse);
  const c10::cuda::CUDAGuard guard(draft.device());
  at::Tensor grad = at::empty_like(draft);
  kernels::launch_vat_row_backward(vat_elem("vat_row_backward", "draft_logits", draft.scalar_type()),
                                   draft.data_ptr(), target.data_ptr(), tokens.data_ptr<int64_t>(),
                                   draft_lse.data_ptr(), target_lse.data_ptr(), g_q.data_ptr(), g_p.data_ptr(),
                                   g_y.data_ptr(), draft.size(0), draft.size(1), grad.data_ptr(),
                                   at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

std::tuple<at::Tensor, at::Tensor> vat_block_weights_cuda(const at::Tensor& accept, const at::Tensor& valid,
                                                          int64_t schedule, double decay_gamma) {
  check_vat_block_weights_inputs(accept, valid, schedule, decay_gamma);
  const c10::cuda::CUDAGuard guard(accept.device());
  const int64_t blocks = accept.size(0), k = accept.size(1);
  at::Tensor first_reject = at::empty({blocks}, accept.options().dtype(at::kInt));
  at::Tensor weights = at::empty({blocks, k}, accept.options());
  kernels::launch_vat_block_weights(accept.data_ptr<float>(), reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>()),
                                    blocks, static_cast<int>(k), static_cast<int>(schedule), decay_gamma,
                                    first_reject.data_ptr<int32_t>(), weights.data_ptr<float>(),
                                    at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {first_reject, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) {
  m.impl("vat_row_forward", &vat_row_forward_cuda);
  m.impl("vat_row_backward", &vat_row_backward_cuda);
  m.impl("vat_block_weights", &vat_block_weights_cuda);
}

}  // namespace dartree
