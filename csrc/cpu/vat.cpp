// CPU kernels of the VAT loss (see csrc/kernels/vat_launchers.h for the contract, shared with the
// CUDA kernels): per-row soft / hard cross-entropies, logsumexps and acceptance; the row gradient;
// per-block first rejection and loss weights. Rows run in parallel. 16/32-bit logits: one pass of
// float32 math in chunks of kChunk values (16-bit ones widened first), maxima and sums together
// (online rescaling), with vec_math.h's exp so that the loops vectorize, each chunk's sums added
// into double accumulators; float64 logits: two passes (max, then sums), std::exp and double.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>

#include "../checks/vat.h"
#include "vec_math.h"

namespace dartree {
namespace {

constexpr int64_t kChunk = 512;

// exp(x), exactly 0 where libm's expf underflows to 0 or below (x <= -87, -inf included); NaN stays
// NaN. Double: std::exp.
template <typename T>
DARTREE_VEC_INLINE T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    const float e = vexp(x);  // computed unconditionally: a select, not a branch, in vector loops
    return x <= -87.0f ? 0.0f : e;
  } else {
    return std::exp(x);
  }
}

// Float32 chunk kernels (n <= kChunk values; AVX2 + FMA builds, DARTREE_AVX2_DISPATCH). exp_of gives -inf logits (and any
// term whose exp underflows) exactly 0, so the dot product never meets 0 * -inf.

// The largest value of x[0, n) (NaN never wins a comparison, as in the scalar loop).
DARTREE_VEC_INLINE float chunk_max_impl(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
DARTREE_AVX2_DISPATCH(float, chunk_max, (const float* x, int64_t n), (x, n))

// sums[0..4] += sum exp(d - max_d), sum exp(t - max_t), sum exp(t - max_t) d and, when `scaled`,
// the two sums at inverse temperature `it`.
DARTREE_VEC_INLINE void chunk_sums_impl(const float* dv, const float* tv, int64_t n, float max_d, float max_t, float it,
                                    bool scaled, double* sums) {
  float sd = 0.0f, st = 0.0f, sdot = 0.0f, sdt = 0.0f, stt = 0.0f;
#pragma omp simd reduction(+ : sd, st, sdot)
  for (int64_t i = 0; i < n; ++i) {
    const float et = exp_of(tv[i] - max_t);
    sd += exp_of(dv[i] - max_d);
    st += et;
    sdot += et != 0.0f ? et * dv[i] : 0.0f;
  }
  if (scaled) {
    const float max_dt = max_d * it, max_tt = max_t * it;
#pragma omp simd reduction(+ : sdt, stt)
    for (int64_t i = 0; i < n; ++i) {
      sdt += exp_of(dv[i] * it - max_dt);
      stt += exp_of(tv[i] * it - max_tt);
    }
  }
  sums[0] += sd, sums[1] += st, sums[2] += sdot, sums[3] += sdt, sums[4] += stt;
}
DARTREE_AVX2_DISPATCH(void, chunk_sums, (const float* dv, const float* tv, int64_t n, float max_d, float max_t, float it, bool scaled, double* sums), (dv, tv, n, max_d, max_t, it, scaled, sums))

// out = exp(x * scale - shift)
DARTREE_VEC_INLINE void chunk_exp_impl(const float* x, int64_t n, float scale, float shift, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = exp_of(x[i] * scale - shift);
}
DARTREE_AVX2_DISPATCH(void, chunk_exp, (const float* x, int64_t n, float scale, float shift, float* out), (x, n, scale, shift, out))

// out = a exp(d - ld) - b exp(t - lt) (t unread when b == 0)
DARTREE_VEC_INLINE void chunk_grad_impl(const float* dv, const float* tv, int64_t n, float a, float b, float ld, float lt,
                                    float* out) {
  if (b != 0.0f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = a * exp_of(dv[i] - ld) - b * exp_of(tv[i] - lt);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = a * exp_of(dv[i] - ld);
  }
}
DARTREE_AVX2_DISPATCH(void, chunk_grad, (const float* dv, const float* tv, int64_t n, float a, float b, float ld, float lt, float* out), (dv, tv, n, a, b, ld, lt, out))

// Raises (m, a) to the chunk's first maximum where it beats m (strictly, so an earlier chunk's
// equal maximum keeps the first index); true when it did.
inline bool raise_max(const float* x, int64_t n, int64_t offset, float* m, int64_t* a) {
  if (!(chunk_max(x, n) > *m)) return false;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > *m) *m = x[i], *a = offset + i;
  return true;
}

// One row's forward statistics from 16/32-bit logits in one pass over float32 chunks (16-bit ones
// widened once): max and first argmax of both rows, and sums[0..4] (see chunk_sums) relative to the
// final maxima. Each chunk's sums use the running maxima; when a maximum rises the sums taken so far
// are rescaled by exp(old - new) (online softmax). While a row has seen only -inf its sums are taken
// against 0, which gives exact zeros, so an all -inf row ends with zero sums (lse = -inf, as the
// float64 path gives). Returns via the pointers.
template <typename scalar_t>
void row_stats_float(const scalar_t* d, const scalar_t* t, int64_t vocab, float it, bool scaled, float* max_d,
                     float* max_t, int64_t* arg_d, int64_t* arg_t, double* sums) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float bd[kChunk], bt[kChunk];
  float md = kNegInf, mt = kNegInf;
  int64_t ad = 0, at = 0;
  for (int64_t s = 0; s < vocab; s += kChunk) {
    const int64_t n = std::min(kChunk, vocab - s);
    const float* dv = as_float(d + s, n, bd);
    const float* tv = as_float(t + s, n, bt);
    const float old_d = md, old_t = mt;
    if (raise_max(dv, n, s, &md, &ad) && old_d != kNegInf) {
      sums[0] *= std::exp(static_cast<double>(old_d) - md);
      sums[3] *= std::exp((static_cast<double>(old_d) - md) * it);
    }
    if (raise_max(tv, n, s, &mt, &at) && old_t != kNegInf) {
      const double r = std::exp(static_cast<double>(old_t) - mt);
      sums[1] *= r, sums[2] *= r;
      sums[4] *= std::exp((static_cast<double>(old_t) - mt) * it);
    }
    chunk_sums(dv, tv, n, md == kNegInf ? 0.0f : md, mt == kNegInf ? 0.0f : mt, it, scaled, sums);
  }
  *max_d = md, *max_t = mt, *arg_d = ad, *arg_t = at;
}

template <typename scalar_t, bool kSample, bool kScaled>
void row_forward(const scalar_t* d, const scalar_t* t, int64_t y, const float* u, int64_t vocab, double inv_temp,
                 double* out /* soft, hard, lse_d, lse_t */, float* accept) {
  using acc_t = at::opmath_type<scalar_t>;  // float, or double for double
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t max_d = kNegInf, max_t = kNegInf;
  int64_t arg_d = 0, arg_t = 0;
  const acc_t it = static_cast<acc_t>(inv_temp);
  double sum_d = 0, sum_t = 0, dot = 0, sum_dt = 0, sum_tt = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    double sums[5] = {0, 0, 0, 0, 0};
    row_stats_float(d, t, vocab, it, kScaled, &max_d, &max_t, &arg_d, &arg_t, sums);
    sum_d = sums[0], sum_t = sums[1], dot = sums[2], sum_dt = sums[3], sum_tt = sums[4];
  } else {
    for (int64_t i = 0; i < vocab; ++i) {
      const acc_t dv = static_cast<acc_t>(d[i]), tv = static_cast<acc_t>(t[i]);
      if (dv > max_d) max_d = dv, arg_d = i;
      if (tv > max_t) max_t = tv, arg_t = i;
    }
    const acc_t max_dt = max_d * it, max_tt = max_t * it;
    for (int64_t i = 0; i < vocab; ++i) {
      const acc_t dv = static_cast<acc_t>(d[i]), tv = static_cast<acc_t>(t[i]);
      if (dv != kNegInf) sum_d += exp_of<acc_t>(dv - max_d);
      if (tv != kNegInf) {
        const acc_t e = exp_of<acc_t>(tv - max_t);
        sum_t += e;
        if (e != acc_t(0)) dot += static_cast<double>(e) * dv;
      }
      if (kScaled) {
        if (dv != kNegInf) sum_dt += exp_of<acc_t>(dv * it - max_dt);
        if (tv != kNegInf) sum_tt += exp_of<acc_t>(tv * it - max_tt);
      }
    }
  }
  if (!kScaled) sum_dt = sum_d, sum_tt = sum_t;
  float accepted = arg_d == arg_t ? 1.0f : 0.0f;
  if (kSample) {
    const acc_t scale = kScaled ? it : acc_t(1);
    const acc_t mdq = kScaled ? max_d * it : max_d, mtp = kScaled ? max_t * it : max_t;
    const double goal = static_cast<double>(u[0]) * sum_dt;
    double cdf = 0;
    int64_t chosen = -1;
    acc_t buf[kChunk], wide[kChunk];
    for (int64_t s = 0; s < vocab && chosen < 0; s += kChunk) {
      const int64_t n = std::min(kChunk, vocab - s);
      if constexpr (std::is_same_v<acc_t, float>) {
        chunk_exp(as_float(d + s, n, wide), n, scale, mdq, buf);
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = exp_of<acc_t>(static_cast<acc_t>(d[s + i]) * scale - mdq);
      }
      for (int64_t i = 0; i < n; ++i) {
        cdf += buf[i];
        if (buf[i] > acc_t(0) && cdf > goal) {
          chosen = s + i;
          break;
        }
      }
    }
    if (chosen < 0) chosen = arg_d;  // the goal fell past the summed total by rounding
    const double q = exp_of<acc_t>(static_cast<acc_t>(d[chosen]) * scale - mdq) / sum_dt;
    const double p = exp_of<acc_t>(static_cast<acc_t>(t[chosen]) * scale - mtp) / sum_tt;
    accepted = static_cast<double>(u[1]) * q < p ? 1.0f : 0.0f;
  }
  const double lse_d = max_d + std::log(sum_d), lse_t = max_t + std::log(sum_t);
  out[0] = lse_d - dot / sum_t;
  out[1] = (y >= 0 && y < vocab) ? lse_d - static_cast<double>(static_cast<acc_t>(d[y]))
                                 : std::numeric_limits<double>::quiet_NaN();
  out[2] = lse_d;
  out[3] = lse_t;
  *accept = accepted;
}

// o = a softmax(d) - b softmax(t) (softmax(x) = exp(x - lse)) for 16/32-bit logits, in float32
// chunks; a -inf logit gets exactly 0 from its term.
template <typename scalar_t>
void row_grad_float(const scalar_t* d, const scalar_t* t, scalar_t* o, int64_t vocab, float a, float b, float ld,
                    float lt) {
  float bd[kChunk], bt[kChunk], bo[kChunk];
  for (int64_t s = 0; s < vocab; s += kChunk) {
    const int64_t n = std::min(kChunk, vocab - s);
    const float* dv = as_float(d + s, n, bd);
    const float* tv = b != 0.0f ? as_float(t + s, n, bt) : nullptr;
    if constexpr (std::is_same_v<scalar_t, float>) {
      chunk_grad(dv, tv, n, a, b, ld, lt, o + s);
    } else {
      chunk_grad(dv, tv, n, a, b, ld, lt, bo);
      for (int64_t i = 0; i < n; ++i) o[s + i] = static_cast<scalar_t>(bo[i]);
    }
  }
}

int64_t row_grain(int64_t vocab) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> vat_row_forward_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const std::optional<at::Tensor>& uniforms,
    double temperature) {
  check_vat_row_forward_inputs(draft, target, tokens, uniforms, temperature);
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  const auto stat = draft.options().dtype(vat_stat_dtype(draft.scalar_type()));
  at::Tensor ce_soft = at::empty({rows}, stat), ce_hard = at::empty({rows}, stat);
  at::Tensor draft_lse = at::empty({rows}, stat), target_lse = at::empty({rows}, stat);
  at::Tensor accept = at::empty({rows}, draft.options().dtype(at::kFloat));
  const bool sample = uniforms.has_value(), scaled = sample && temperature != 1.0;
  const float* u = sample ? uniforms->data_ptr<float>() : nullptr;
  const int64_t* y = tokens.data_ptr<int64_t>();
  float* acc_out = accept.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, draft.scalar_type(), "vat_row_forward", [&] {
    using stat_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* d = draft.data_ptr<scalar_t>();
    const scalar_t* t = target.data_ptr<scalar_t>();
    stat_t* outs[4] = {ce_soft.data_ptr<stat_t>(), ce_hard.data_ptr<stat_t>(), draft_lse.data_ptr<stat_t>(),
                       target_lse.data_ptr<stat_t>()};
    const double inv_temp = sample ? 1.0 / temperature : 1.0;
    at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        double out[4];
        const scalar_t* dr = d + r * vocab;
        const scalar_t* tr = t + r * vocab;
        const float* ur = sample ? u + 2 * r : nullptr;
        if (!sample) {
          row_forward<scalar_t, false, false>(dr, tr, y[r], ur, vocab, inv_temp, out, acc_out + r);
        } else if (!scaled) {
          row_forward<scalar_t, true, false>(dr, tr, y[r], ur, vocab, inv_temp, out, acc_out + r);
        } else {
          row_forward<scalar_t, true, true>(dr, tr, y[r], ur, vocab, inv_temp, out, acc_out + r);
        }
        for (int j = 0; j < 4; ++j) outs[j][r] = static_cast<stat_t>(out[j]);
      }
    });
  });
  return {ce_soft, ce_hard, accept, draft_lse, target_lse};
}

at::Tensor vat_row_backward_cpu(const at::Tensor& g_q, const at::Tensor& g_p, const at::Tensor& g_y,
                                const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,
                                const at::Tensor& draft_lse, const at::Tensor& target_lse) {
  check_vat_row_backward_inputs(g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse);
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  at::Tensor grad = at::empty_like(draft);
  const int64_t* y = tokens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, draft.scalar_type(), "vat_row_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* d = draft.data_ptr<scalar_t>();
    const scalar_t* t = target.data_ptr<scalar_t>();
    scalar_t* out = grad.data_ptr<scalar_t>();
    const acc_t* cq = g_q.data_ptr<acc_t>();
    const acc_t* cp = g_p.data_ptr<acc_t>();
    const acc_t* cy = g_y.data_ptr<acc_t>();
    const acc_t* lse_d = draft_lse.data_ptr<acc_t>();
    const acc_t* lse_t = target_lse.data_ptr<acc_t>();
    at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* o = out + r * vocab;
        const acc_t a = cq[r], b = cp[r], c = cy[r];
        if (a == acc_t(0) && b == acc_t(0) && c == acc_t(0)) {
          for (int64_t i = 0; i < vocab; ++i) o[i] = scalar_t(0);
          continue;
        }
        const scalar_t* dr = d + r * vocab;
        const scalar_t* tr = t + r * vocab;
        const acc_t ld = lse_d[r], lt = lse_t[r];
        if constexpr (std::is_same_v<acc_t, float>) {
          row_grad_float(dr, tr, o, vocab, a, b, ld, lt);
        } else if (b != acc_t(0)) {
          for (int64_t i = 0; i < vocab; ++i)
            o[i] = static_cast<scalar_t>(a * exp_of<acc_t>(static_cast<acc_t>(dr[i]) - ld) -
                                         b * exp_of<acc_t>(static_cast<acc_t>(tr[i]) - lt));
        } else {
          for (int64_t i = 0; i < vocab; ++i) o[i] = static_cast<scalar_t>(a * exp_of<acc_t>(static_cast<acc_t>(dr[i]) - ld));
        }
        if (y[r] >= 0 && y[r] < vocab) {
          const int64_t i = y[r];
          acc_t g = a * exp_of<acc_t>(static_cast<acc_t>(dr[i]) - ld) - c;
          if (b != acc_t(0)) g -= b * exp_of<acc_t>(static_cast<acc_t>(tr[i]) - lt);
          o[i] = static_cast<scalar_t>(g);
        }
      }
    });
  });
  return grad;
}

// In double, rounded once to float: the same value the reference and the CUDA kernel give.
float block_weight(int64_t schedule, int64_t k, int64_t k_star, double gamma) {
  switch (static_cast<kernels::VatSchedule>(schedule)) {
    case kernels::VatSchedule::kVat:
      return k < k_star ? 1.0f : static_cast<float>(std::exp(-static_cast<double>(k - k_star) / gamma));
    case kernels::VatSchedule::kDflash: return static_cast<float>(std::exp(-static_cast<double>(k - 1) / gamma));
    case kernels::VatSchedule::kPrefixOnly: return k < k_star ? 1.0f : 0.0f;
    case kernels::VatSchedule::kHardCutoff: return k <= k_star ? 1.0f : 0.0f;
    default: return k < k_star ? 1.0f : static_cast<float>(std::exp(-static_cast<double>(k - 1) / gamma));
  }
}

std::tuple<at::Tensor, at::Tensor> vat_block_weights_cpu(const at::Tensor& accept, const at::Tensor& valid,
                                                         int64_t schedule, double decay_gamma) {
  check_vat_block_weights_inputs(accept, valid, schedule, decay_gamma);
  const int64_t blocks = accept.size(0), k = accept.size(1);
  at::Tensor first_reject = at::empty({blocks}, accept.options().dtype(at::kInt));
  at::Tensor weights = at::empty({blocks, k}, accept.options());
  const float* acc = accept.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  int32_t* fr = first_reject.data_ptr<int32_t>();
  float* w = weights.data_ptr<float>();
  for (int64_t m = 0; m < blocks; ++m) {
    int64_t k_star = k + 1;
    for (int64_t j = 0; j < k; ++j) {
      if (ok[m * k + j] && acc[m * k + j] == 0.0f) {
        k_star = j + 1;
        break;
      }
    }
    fr[m] = static_cast<int32_t>(k_star);
    for (int64_t j = 0; j < k; ++j) w[m * k + j] = ok[m * k + j] ? block_weight(schedule, j + 1, k_star, decay_gamma) : 0.0f;
  }
  return {first_reject, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("vat_row_forward", &vat_row_forward_cpu);
  m.impl("vat_row_backward", &vat_row_backward_cpu);
  m.impl("vat_block_weights", &vat_block_weights_cpu);
}

}  // namespace dartree
