// CPU kernels for a drafter pass's small elementwise steps, one call each instead of the 8-17
// ATen calls their PyTorch forms make: rms_norm_rows (a drafter's RMSNorm) and rotary_rows (its
// rotate-half rotary embedding). A drafter pass runs right after the target's forward, when every
// library code path it touches is cold and each small ATen call costs tens of microseconds on a
// small VM; these loops are a few kilobytes of code. The math and rounding follow the PyTorch
// forms (dartree_ext.models.drafter.RMSNorm and _rope): float32 throughout, one rounding to the
// input's dtype where those round.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../checks/common.h"

namespace dartree {
namespace {

template <typename T>
T round_to(float v) {
  return static_cast<T>(v);  // bfloat16: round to nearest even
}

// y = weight * (x / sqrt(mean(x^2) + eps)) with the normalized row rounded to the dtype first and
// the product rounded again (as `weight * x.float().mul(rsqrt(...)).to(dtype)` does).
template <typename T>
void rms_norm_rows_impl(const T* x, const T* weight, T* y, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      float sum = 0.0f;
      for (int64_t j = 0; j < h; ++j) {
        row[j] = static_cast<float>(xr[j]);
        sum += row[j] * row[j];
      }
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      T* yr = y + r * h;
      for (int64_t j = 0; j < h; ++j) {
        const float normed = static_cast<float>(round_to<T>(row[j] * scale));
        yr[j] = round_to<T>(static_cast<float>(weight[j]) * normed);
      }
    }
  });
}

at::Tensor rms_norm_rows_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_rows";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must be [..., H] with H >= 1, got ", x.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  check_tensor(op, "weight", wc, x.scalar_type(), 1);
  check_shape(op, "weight", wc, {x.size(-1)});
  check_same_device(op, "weight", wc, x, "x");
  at::Tensor y = at::empty_like(xc);
  const int64_t h = x.size(-1), rows = xc.numel() / h;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows_impl(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, h, static_cast<float>(eps));
  else
    rms_norm_rows_impl(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows,
                       h, static_cast<float>(eps));
  return y;
}

// Rotate-half rotary embedding of x [B, H, T, Dh] at positions int64 [B or 1, T]: with
// inv[i] = theta^(-i / half) and a = position * inv[i], out[i] = x[i] cos a - x[i + half] sin a and
// out[i + half] = x[i + half] cos a + x[i] sin a, in float32, rounded once to x's dtype.
template <typename T>
void rotary_rows_impl(const T* x, const int64_t* positions, T* y, int64_t batch, int64_t heads, int64_t t,
                      int64_t dh, int64_t pos_batch, float theta, const int64_t* x_strides) {
  const int64_t half = dh / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; ++i)
    inv[i] = std::pow(theta, -static_cast<float>(i) / static_cast<float>(half));
  // the angles' cos / sin per (request, step), shared by every head
  std::vector<float> cs(batch * t * half), sn(batch * t * half);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < t; ++s) {
      const float p = static_cast<float>(positions[(pos_batch == 1 ? 0 : b) * t + s]);
      for (int64_t i = 0; i < half; ++i) {
        const float a = p * inv[i];
        cs[(b * t + s) * half + i] = std::cos(a);
        sn[(b * t + s) * half + i] = std::sin(a);
      }
    }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hd = 0; hd < heads; ++hd)
      for (int64_t s = 0; s < t; ++s) {
        const T* xr = x + b * x_strides[0] + hd * x_strides[1] + s * x_strides[2];
        T* yr = y + ((b * heads + hd) * t + s) * dh;
        const float* c = cs.data() + (b * t + s) * half;
        const float* n = sn.data() + (b * t + s) * half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
          yr[i] = round_to<T>(x1 * c[i] - x2 * n[i]);
          yr[i + half] = round_to<T>(x2 * c[i] + x1 * n[i]);
        }
      }
}

at::Tensor rotary_rows_cpu(const at::Tensor& x, const at::Tensor& positions, double theta) {
  const char* op = "rotary_rows";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1, op,
              ": x must be [B, H, T, Dh] with an even Dh and unit stride in it, got ", x.sizes(), " strides ",
              x.strides());
  const at::Tensor pc = positions.contiguous();  // (an expanded batch of positions is fine)
  check_tensor(op, "positions", pc, at::kLong, 2);
  TORCH_CHECK((positions.size(0) == x.size(0) || positions.size(0) == 1) && positions.size(1) == x.size(2), op,
              ": positions must be [B or 1, T] for x ", x.sizes(), ", got ", positions.sizes());
  check_same_device(op, "positions", positions, x, "x");
  TORCH_CHECK_VALUE(theta > 0, op, ": theta must be > 0, got ", theta);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t strides[3] = {x.stride(0), x.stride(1), x.stride(2)};
  if (x.scalar_type() == at::kFloat)
    rotary_rows_impl(x.data_ptr<float>(), pc.data_ptr<int64_t>(), y.data_ptr<float>(), x.size(0), x.size(1),
                     x.size(2), x.size(3), pc.size(0), static_cast<float>(theta), strides);
  else
    rotary_rows_impl(x.data_ptr<c10::BFloat16>(), pc.data_ptr<int64_t>(), y.data_ptr<c10::BFloat16>(), x.size(0),
                     x.size(1), x.size(2), x.size(3), pc.size(0), static_cast<float>(theta), strides);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows_cpu);
  m.impl("rotary_rows", &rotary_rows_cpu);
}

}  // namespace dartree
