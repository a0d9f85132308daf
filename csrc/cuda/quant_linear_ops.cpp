// CUDA op for quant_linear: checks, device guard, float32 staging of x and the bias, the output
// in x's dtype, the current stream. Plain C++ (no nvcc): the kernel is compiled from
// csrc/kernels/quant_linear.cuh by csrc/cuda/quant_linear.cu.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks/quant.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

at::Tensor quant_linear_cuda(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                             const std::optional<at::Tensor>& bias) {
  const QuantShape s = check_quant_inputs("quant_linear", x, blocks, std::string(kind), bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const QuantStaging staged = stage_quant_inputs(x, s, bias);
  if (staged.empty()) return at::empty(staged.out_shape, x.options());
  at::Tensor y32 = at::empty({s.rows, s.out}, x.options().dtype(at::kFloat));
  kernels::launch_quant_linear(staged.x32.data_ptr<float>(), blocks.data_ptr<uint8_t>(), staged.bias_ptr(), s.kind,
                               static_cast<int>(s.rows), static_cast<int>(s.in), static_cast<int>(s.out), s.row_bytes,
                               y32.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y32.to(x.scalar_type()).reshape(staged.out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) { m.impl("quant_linear", &quant_linear_cuda); }

}  // namespace dartree
