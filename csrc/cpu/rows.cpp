// CPU kernels for a decoding round's small per-row steps, one call each instead of the 5-17 ATen
// calls their PyTorch forms make: rms_norm_rows (a drafter's RMSNorm), rotary_rows (its rotate-half
// rotary embedding) and tokens_from_logits (the target's token at each verified node, greedy or
// sampled). They run right after the target's forward, when every library code path is cold and
// each small ATen call costs tens of microseconds on a small VM; these loops are a few kilobytes
// of code. The math and rounding follow the PyTorch
// forms (dartree_ext.models.drafter.RMSNorm and _rope): float32 throughout, one rounding to the
// input's dtype where those round.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <string>
#include <type_traits>
#include <vector>

#include "../checks/common.h"
#include "vec_math.h"

namespace dartree {
namespace {

template <typename T>
T round_to(float v) {
  return static_cast<T>(v);  // bfloat16: round to nearest even
}

// y = weight * (x / sqrt(mean(x^2) + eps)) with the normalized row rounded to the dtype first and
// the product rounded again (as `weight * x.float().mul(rsqrt(...)).to(dtype)` does). The sum of
// squares runs in 16 lanes (element j in lane j % 16, the lanes then added in order): the same
// for a row whatever the other rows, so a tree's rows round as plain steps do.
constexpr int64_t kNormLanes = 16;

template <typename T>
DARTREE_VEC_INLINE void rms_norm_row(const T* xr, const float* w, T* yr, int64_t h, float eps, float* row) {
  widen(xr, row, h);
  float lanes[kNormLanes] = {};
  int64_t j = 0;
  for (; j + kNormLanes <= h; j += kNormLanes)
#pragma omp simd
    for (int64_t l = 0; l < kNormLanes; ++l) lanes[l] += row[j + l] * row[j + l];
  for (int64_t l = 0; j < h; ++j, ++l) lanes[l] += row[j] * row[j];
  float sum = 0.0f;
  for (int64_t l = 0; l < kNormLanes; ++l) sum += lanes[l];
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = w[i] * (row[i] * scale);
  } else {
    uint16_t* out = reinterpret_cast<uint16_t*>(yr);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = bf16_bits(w[i] * bf16_round(row[i] * scale));
  }
}

template <typename T>
void rms_norm_rows_impl(const T* x, const T* weight, T* y, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * h);
    float* w = buffer.data() + h;
    widen(weight, w, h);
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * h, w, y + r * h, h, eps, buffer.data());
  });
}

at::Tensor rms_norm_rows_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_rows";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must be [..., H] with H >= 1, got ", x.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
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
  TORCH_CHECK_VALUE(std::isfinite(theta) && theta > 0, op, ": theta must be finite and > 0, got ", theta);
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

// A transformers model's rotate-half rotary embedding (`apply_rotary_pos_emb`) of q and k
// [B, H, T, Dh] with its cos / sin tables [B or 1, T, Dh] (x's dtype): out = x * cos +
// rotate_half(x) * sin, each product and the sum rounded to the dtype as those three PyTorch calls
// round them (the same values; a NaN's payload may differ). float32: the products are stored
// before the sums, and contraction into fused multiply-adds (one rounding) is switched off for
// this function (GCC's optimize attribute, clang's pragma), so no build fuses them.
#if defined(__clang__)
#define DARTREE_NO_FP_CONTRACT
#elif defined(__GNUC__)
#define DARTREE_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define DARTREE_NO_FP_CONTRACT
#endif
DARTREE_NO_FP_CONTRACT void rotary_row(const float* x, const float* c, const float* n, float* y, int64_t half,
                                       float* scratch) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float* p = scratch;  // [4, half]: x1 c1, x2 s1, x2 c2, x1 s2
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    p[i] = x[i] * c[i];
    p[half + i] = x[i + half] * n[i];
    p[2 * half + i] = x[i + half] * c[i + half];
    p[3 * half + i] = x[i] * n[i + half];
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    y[i] = p[i] - p[half + i];
    y[i + half] = p[2 * half + i] + p[3 * half + i];
  }
}

DARTREE_VEC_INLINE void rotary_row(const c10::BFloat16* xb, const c10::BFloat16* cb, const c10::BFloat16* nb,
                                   c10::BFloat16* yb, int64_t half, float*) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xb);
  const uint16_t* c = reinterpret_cast<const uint16_t*>(cb);
  const uint16_t* n = reinterpret_cast<const uint16_t*>(nb);
  uint16_t* y = reinterpret_cast<uint16_t*>(yb);
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = bf16_float(x[i]), x2 = bf16_float(x[i + half]);
    y[i] = bf16_bits(bf16_round(x1 * bf16_float(c[i])) - bf16_round(x2 * bf16_float(n[i])));
    y[i + half] = bf16_bits(bf16_round(x2 * bf16_float(c[i + half])) + bf16_round(x1 * bf16_float(n[i + half])));
  }
}

template <typename T>
void rotary_tables_impl(const at::Tensor& x, const T* cs, const T* sn, int64_t table_batch, at::Tensor& y) {
  const int64_t batch = x.size(0), heads = x.size(1), t = x.size(2), dh = x.size(3), half = dh / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, batch * heads * t, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(std::is_same_v<T, float> ? 4 * half : 0);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r % t, hd = (r / t) % heads, b = r / (t * heads);
      const int64_t table = ((table_batch == 1 ? 0 : b) * t + s) * dh;
      rotary_row(xp + b * s0 + hd * s1 + s * s2, cs + table, sn + table, yp + r * dh, half, scratch.data());
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_tables_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin) {
  const char* op = "rotary_tables";
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": q must be float32 or bfloat16, got ", dtype);
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 4 && x->size(3) % 2 == 0 && x->stride(3) == 1 && x->scalar_type() == dtype, op,
                ": q and k must be [B, H, T, Dh] of one dtype with an even Dh and unit stride in it, got ", x->sizes(),
                " ", x->scalar_type(), " strides ", x->strides());
    check_same_device(op, "k", *x, q, "q");
  }
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3), op,
              ": k ", k.sizes(), " does not match q ", q.sizes());
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  for (const at::Tensor* tbl : {&cc, &sc}) {
    check_tensor(op, "cos / sin", *tbl, dtype, 3);
    TORCH_CHECK((tbl->size(0) == q.size(0) || tbl->size(0) == 1) && tbl->size(1) == q.size(2) &&
                    tbl->size(2) == q.size(3),
                op, ": cos / sin must be [B or 1, T, Dh] for q ", q.sizes(), ", got ", tbl->sizes());
    check_same_device(op, "cos / sin", *tbl, q, "q");
  }
  TORCH_CHECK(cc.size(0) == sc.size(0), op, ": cos ", cc.sizes(), " and sin ", sc.sizes(), " differ");
  auto rotate = [&](const at::Tensor& x) {
    at::Tensor y = at::empty(x.sizes(), x.options());
    if (dtype == at::kFloat)
      rotary_tables_impl<float>(x, cc.data_ptr<float>(), sc.data_ptr<float>(), cc.size(0), y);
    else
      rotary_tables_impl<c10::BFloat16>(x, cc.data_ptr<c10::BFloat16>(), sc.data_ptr<c10::BFloat16>(), cc.size(0), y);
    return y;
  };
  return {rotate(q), rotate(k)};
}

// A SwiGLU MLP's silu(gate) * up in one pass: silu rounded to the dtype, then the product rounded
// again, as `act_fn(gate) * up` rounds (Lanes::silu: its exp has relative error about 1e-7, so a
// bfloat16 result can differ from PyTorch's in its last bit where silu lands next to a rounding
// boundary; -0 below -88 and NaN at -inf).
template <int N, typename T>
DARTREE_VEC_INLINE void silu_mul_impl(const T* g, const T* u, T* y, int64_t n) {
  using L = Lanes<N>;
  L::binary(g, u, y, n, [](const T* gn, const T* un, T* yn) {
    typename L::F s = L::silu(L::load(gn));
    if constexpr (std::is_same_v<T, uint16_t>) s = L::round_bf16(s);  // as act_fn(gate) stores it
    L::store(yn, s * L::load(un));
  });
}
// (one name, two overloads: float32 and bfloat16 bits)
DARTREE_LANES_DISPATCH(void, silu_mul, (const float* g, const float* u, float* y, int64_t n), (g, u, y, n))
DARTREE_LANES_DISPATCH(void, silu_mul, (const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n), (g, u, y, n))

// silu_mul through one build: "avx512", "avx2", "base" or "auto" (the one the CPU runs fastest).
at::Tensor silu_mul_with(const at::Tensor& gate, const at::Tensor& up, const std::string& build) {
  const char* op = "silu_mul";
  const auto dtype = gate.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": gate must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(up.scalar_type() == dtype && up.sizes() == gate.sizes(), op, ": up must match gate ", gate.sizes(), " ",
              dtype, ", got ", up.sizes(), " ", up.scalar_type());
  check_same_device(op, "up", up, gate, "gate");
  using F32 = void (*)(const float*, const float*, float*, int64_t);
  using BF16 = void (*)(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
  F32 f32 = &silu_mul;
  BF16 bf16 = &silu_mul;
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__CUDACC__)
  if (build == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), op, ": this CPU has no AVX-512 (F, BW, VL, DQ)");
    f32 = &silu_mul_avx512, bf16 = &silu_mul_avx512;
  } else if (build == "avx2") {
    TORCH_CHECK(cpu_has_avx2_fma(), op, ": this CPU has no AVX2 + FMA");
    f32 = &silu_mul_avx2, bf16 = &silu_mul_avx2;
  } else if (build == "base") {
    f32 = &silu_mul_base, bf16 = &silu_mul_base;
  } else {
    TORCH_CHECK(build == "auto", op, ": build must be avx512, avx2, base or auto, got ", build);
  }
#else
  TORCH_CHECK(build == "auto" || build == "base", op, ": this build has only its portable loop, got ", build);
#endif
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty(g.sizes(), g.options());
  const int64_t n = g.numel();
  constexpr int64_t kGrain = 1 << 14;  // an MLP's 1536 x 12 rows on one thread, a prefill's on all
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      f32(g.data_ptr<float>() + begin, u.data_ptr<float>() + begin, y.data_ptr<float>() + begin, end - begin);
    else
      bf16(reinterpret_cast<const uint16_t*>(g.data_ptr<c10::BFloat16>()) + begin,
           reinterpret_cast<const uint16_t*>(u.data_ptr<c10::BFloat16>()) + begin,
           reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()) + begin, end - begin);
  });
  return y;
}
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) { return silu_mul_with(gate, up, "auto"); }

// The target's token at each verified node, from its logits [R, V]: the first maximum (ties to
// the lowest id; a NaN wins, at its first place, as torch.argmax has it), or a sample of
// softmax(logits / temperature) by the inverse CDF at uniforms[r] (float32 in [0, 1)): the first
// token whose cumulative exp(x - max) exceeds u times the row's total, never a token of zero
// probability. The sums run over blocks of 64 (block totals, then the prefix within the block),
// so the vocabulary is read about twice; exp is float32 math (vexp: relative error about 1e-7,
// 0 below e^-87 of the maximum). One call for every row, in place of the 5-8 ATen calls (and a
// float32 copy of the logits) of the PyTorch form.
constexpr int64_t kSampleBlock = 64;

template <typename T>
DARTREE_VEC_INLINE float max_of_impl(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, static_cast<float>(x[j]));
  return m;
}
DARTREE_VEC_INLINE float max_f32_impl(const float* x, int64_t n) { return max_of_impl(x, n); }
DARTREE_AVX2_DISPATCH(float, max_f32, (const float* x, int64_t n), (x, n))

DARTREE_VEC_INLINE bool any_nan_impl(const float* x, int64_t n) {
  int found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t j = 0; j < n; ++j) found |= x[j] != x[j];
  return found != 0;
}
DARTREE_AVX2_DISPATCH(bool, any_nan, (const float* x, int64_t n), (x, n))

// out[j] = exp(scale * (x[j] - top)) (0 where that is below e^-87), returns their sum
DARTREE_VEC_INLINE float exp_block_impl(const float* x, int64_t n, float top, float inv_t, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float a = (x[j] - top) * inv_t;
    const float e = a < -87.0f ? 0.0f : vexp(a);
    out[j] = e;
    sum += e;
  }
  return sum;
}
DARTREE_AVX2_DISPATCH(float, exp_block, (const float* x, int64_t n, float top, float inv_t, float* out),
                      (x, n, top, inv_t, out))

// A row tokens_from_rows refuses: 1 holds a NaN, 2 has no token of positive probability (all -inf).
template <typename T>
void tokens_from_rows(const T* logits, const float* uniforms, int64_t* out, int64_t rows, int64_t v,
                      float temperature, int8_t* refused) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(v), exps(v), block_sum((v + kSampleBlock - 1) / kSampleBlock);
    for (int64_t r = begin; r < end; ++r) {
      widen(logits + r * v, row.data(), v);
      const float top = max_f32(row.data(), v);  // (NaN ignored)
      int64_t best = -1;
      if (any_nan(row.data(), v) || top == -std::numeric_limits<float>::infinity()) {
        refused[r] = any_nan(row.data(), v) ? 1 : 2;
        out[r] = -1;
        continue;
      } else {  // the first block of 64 holding the maximum, then its place there
        for (int64_t lo = 0; lo < v && best < 0; lo += kSampleBlock) {
          const int64_t n = std::min(kSampleBlock, v - lo);
          if (max_f32(row.data() + lo, n) == top)
            for (int64_t j = lo; j < lo + n; ++j)
              if (row[j] == top) {
                best = j;
                break;
              }
        }
      }
      // x / T - max / T: the max of x / T is max / T (division by T > 0 is monotone)
      const float inv_t = temperature > 0.0f ? 1.0f / temperature : 0.0f;
      // the first maximum: greedy, and where sampling would have no finite weights (a +inf logit
      // takes all the mass; a temperature so small that 1 / T overflows is greedy)
      if (temperature <= 0.0f || top == std::numeric_limits<float>::infinity() || !std::isfinite(inv_t)) {
        out[r] = std::max<int64_t>(best, 0);
        continue;
      }
      float total = 0.0f;
      const int64_t blocks = static_cast<int64_t>(block_sum.size());
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * kSampleBlock, n = std::min(kSampleBlock, v - lo);
        block_sum[b] = exp_block(row.data() + lo, n, top, inv_t, exps.data() + lo);
        total += block_sum[b];
      }
      const float threshold = uniforms[r] * total;
      int64_t pick = -1;
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks && pick < 0; ++b) {
        if (acc + block_sum[b] <= threshold) {
          acc += block_sum[b];
          continue;
        }
        const int64_t lo = b * kSampleBlock, n = std::min(kSampleBlock, v - lo);
        for (int64_t j = 0; j < n; ++j) {
          acc += exps[lo + j];
          if (acc > threshold && exps[lo + j] > 0.0f) {
            pick = lo + j;
            break;
          }
        }
      }
      if (pick < 0)  // u * total rounded up to the total: the last token of positive probability
        for (int64_t j = v - 1; j >= 0 && pick < 0; --j)
          if (exps[j] > 0.0f) pick = j;
      out[r] = pick < 0 ? 0 : pick;
    }
  });
}

at::Tensor tokens_from_logits_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& uniforms,
                                  double temperature) {
  const char* op = "tokens_from_logits";
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
              ": logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1, op, ": logits must be [..., V] with V >= 1, got ",
              logits.sizes());
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature >= 0, op, ": temperature must be finite and >= 0, got ",
                    temperature);
  const at::Tensor lc = logits.contiguous();
  const int64_t v = lc.size(-1), rows = lc.numel() / v;
  std::vector<int64_t> out_shape(lc.sizes().begin(), lc.sizes().end() - 1);
  at::Tensor out = at::empty(out_shape, lc.options().dtype(at::kLong));
  at::Tensor uc;
  if (temperature > 0) {
    TORCH_CHECK(uniforms.has_value(), op, ": sampling (temperature > 0) needs uniforms");
    uc = uniforms->contiguous();
    check_tensor(op, "uniforms", uc, at::kFloat, uc.dim());
    TORCH_CHECK(uc.numel() == rows, op, ": uniforms must hold one value per row (", rows, "), got ", uc.sizes());
    check_same_device(op, "uniforms", uc, lc, "logits");
    const float* uv = uc.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK_VALUE(uv[r] >= 0.0f && uv[r] < 1.0f, op, ": uniforms[", r, "] = ", uv[r],
                        " is outside [0, 1)");
  }
  const float* u = temperature > 0 ? uc.data_ptr<float>() : nullptr;
  std::vector<int8_t> refused(rows, 0);
  if (lc.scalar_type() == at::kFloat)
    tokens_from_rows(lc.data_ptr<float>(), u, out.data_ptr<int64_t>(), rows, v, static_cast<float>(temperature),
                     refused.data());
  else
    tokens_from_rows(lc.data_ptr<c10::BFloat16>(), u, out.data_ptr<int64_t>(), rows, v,
                     static_cast<float>(temperature), refused.data());
  for (int64_t r = 0; r < rows; ++r)  // (a row index over logits' leading dims, flattened)
    TORCH_CHECK_VALUE(refused[r] == 0, op, ": logits row ", r, " of ", rows,
                      refused[r] == 1 ? " holds a NaN" : " is all -inf (no token has positive probability)",
                      ": no token can be drawn from it");
  return out;
}

}  // namespace

// Which build of the N-lane row ops (silu_mul) runs on this CPU: "avx512", "avx2" or "base"
// (build_info()["vector_build"]).
std::string vector_build_name() {
  return cpu_has_avx512() ? "avx512" : cpu_has_avx2_fma() ? "avx2" : "base";
}

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows_cpu);
  m.impl("rotary_rows", &rotary_rows_cpu);
  m.impl("rotary_tables", &rotary_tables_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("silu_mul_build", &silu_mul_with);
  m.impl("tokens_from_logits", &tokens_from_logits_cpu);
}

}  // namespace dartree
