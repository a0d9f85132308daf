// Device code for the VAT (verification-aware training) loss, see DESIGN.md "VAT" and
// dartree_ext/vat.py for the math. Three kernels:
//  * vat_row_forward  (grid R, one block per row of V logits): one online pass over the draft and
//    target rows (max / argmax, sum of exp, and sum_i p_i * draft_i for the soft CE, each rescaled
//    when the running max grows; 16-byte vector loads where the rows are aligned), a block merge
//    in a fixed order (deterministic), then for the sampling rule an inverse-CDF scan of
//    softmax(draft / T) over the one segment of the row (each warp reads a contiguous segment)
//    whose mass passes the sample;
//  * vat_row_backward (grid R): grad = g_q q - g_p p - g_y onehot(y) from the saved logsumexps;
//  * vat_block_weights (one thread per block of K positions): first rejection and loss weights.
// Logits are float32, bfloat16, float16 (float32 arithmetic) or float64 (float64 arithmetic).
#pragma once

#include "block_ops.cuh"
#include "elem.cuh"
#include "vat_launchers.h"

namespace dartree {
namespace kernels {

constexpr int kVatMaxThreads = 256;

template <typename Acc>
DARTREE_DEVICE Acc vat_exp(Acc x) {
  return exp(x);
}
template <>
DARTREE_DEVICE float vat_exp<float>(float x) {
  return expf(x);
}
template <typename Acc>
DARTREE_DEVICE Acc vat_log(Acc x) {
  return log(x);
}
template <>
DARTREE_DEVICE float vat_log<float>(float x) {
  return logf(x);
}

// A running (max, sum exp(x - max)) pair; `dot` = sum exp(x - max) * other, when tracked.
template <typename Acc>
struct OnlineLse {
  Acc max, sum, dot;
  int arg;  // index of the first maximum
};

template <typename Acc>
DARTREE_DEVICE OnlineLse<Acc> lse_empty() {
  return OnlineLse<Acc>{static_cast<Acc>(-__builtin_huge_val()), Acc(0), Acc(0), kNoCandidate};
}

// Adds element `i` with value x (and the paired value y for `dot`). Indices arrive increasing per
// thread, so '>' keeps the first maximum. A -inf element adds nothing (no exp(-inf - -inf)); a NaN
// poisons the sum (as it should: the loss must come out NaN, and the wrappers report it).
template <typename Acc, bool kDot>
DARTREE_DEVICE void lse_add(OnlineLse<Acc>& s, Acc x, Acc y, int i) {
  const bool minus_inf = x == static_cast<Acc>(-__builtin_huge_val());
  if (s.arg == kNoCandidate) {  // the first element this thread sees
    s.max = x;
    s.arg = i;
    s.sum = minus_inf ? Acc(0) : Acc(1);
    if (kDot) s.dot = minus_inf ? Acc(0) : y;
  } else if (x > s.max) {
    const Acc scale = vat_exp<Acc>(s.max - x);  // 0 when the old max is -inf
    s.sum = s.sum * scale + Acc(1);
    if (kDot) s.dot = s.dot * scale + y;
    s.max = x;
    s.arg = i;
  } else if (!minus_inf) {
    const Acc e = vat_exp<Acc>(x - s.max);
    s.sum += e;
    if (kDot && e != Acc(0)) s.dot += e * y;
  }
}

// Merges b (covering higher indices on ties, or not: ties go to the lower index) into a.
template <typename Acc, bool kDot>
DARTREE_DEVICE OnlineLse<Acc> lse_merge(OnlineLse<Acc> a, OnlineLse<Acc> b) {
  if (b.arg == kNoCandidate) return a;
  if (a.arg == kNoCandidate) return b;
  OnlineLse<Acc> r;
  const bool b_wins = b.max > a.max || (b.max == a.max && b.arg < a.arg);
  r.max = b.max > a.max ? b.max : a.max;
  r.arg = b_wins ? b.arg : a.arg;
  const Acc neg_inf = static_cast<Acc>(-__builtin_huge_val());
  if (r.max == neg_inf) {  // everything -inf so far
    r.sum = a.sum + b.sum;
    r.dot = a.dot + b.dot;
    return r;
  }
  const Acc sa = a.max == neg_inf ? Acc(0) : vat_exp<Acc>(a.max - r.max);
  const Acc sb = b.max == neg_inf ? Acc(0) : vat_exp<Acc>(b.max - r.max);
  r.sum = a.sum * sa + b.sum * sb;
  r.dot = kDot ? (sa != Acc(0) ? a.dot * sa : Acc(0)) + (sb != Acc(0) ? b.dot * sb : Acc(0)) : Acc(0);
  return r;
}

template <typename Acc>
DARTREE_DEVICE OnlineLse<Acc> lse_shfl_xor(const OnlineLse<Acc>& s, int offset) {
  OnlineLse<Acc> o;
  o.max = __shfl_xor_sync(kFullWarpMask, s.max, offset);
  o.sum = __shfl_xor_sync(kFullWarpMask, s.sum, offset);
  o.dot = __shfl_xor_sync(kFullWarpMask, s.dot, offset);
  o.arg = __shfl_xor_sync(kFullWarpMask, s.arg, offset);
  return o;
}

// The per-thread statistics of a row: draft and target at temperature 1 (target with the dot
// product sum_i e^(t_i - max) d_i), and draft / target at temperature T for the sampling rule.
template <typename Acc>
struct RowStats {
  OnlineLse<Acc> d, t, dt, tt;
};

// Block-wide merge of every thread's RowStats: warp butterflies, then warp 0's lane 0 folds the
// warps in order. Every thread gets the result. `s_warps` holds 33 RowStats.
template <typename Acc, bool kScaled>
DARTREE_DEVICE RowStats<Acc> block_merge_stats(RowStats<Acc> mine, RowStats<Acc>* s_warps) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = (blockDim.x + warpSize - 1) / warpSize;
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    mine.d = lse_merge<Acc, false>(mine.d, lse_shfl_xor(mine.d, offset));
    mine.t = lse_merge<Acc, true>(mine.t, lse_shfl_xor(mine.t, offset));
    if (kScaled) {
      mine.dt = lse_merge<Acc, false>(mine.dt, lse_shfl_xor(mine.dt, offset));
      mine.tt = lse_merge<Acc, false>(mine.tt, lse_shfl_xor(mine.tt, offset));
    }
  }
  if (lane == 0) s_warps[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowStats<Acc> all = s_warps[0];
    for (int w = 1; w < warps; ++w) {
      all.d = lse_merge<Acc, false>(all.d, s_warps[w].d);
      all.t = lse_merge<Acc, true>(all.t, s_warps[w].t);
      if (kScaled) {
        all.dt = lse_merge<Acc, false>(all.dt, s_warps[w].dt);
        all.tt = lse_merge<Acc, false>(all.tt, s_warps[w].tt);
      }
    }
    s_warps[32] = all;
  }
  __syncthreads();
  return s_warps[32];
}

// The q_T mass of warp w's segment (its per-warp statistics from block_merge_stats), relative to
// exp(max) of the whole row.
template <typename Acc>
DARTREE_DEVICE Acc segment_mass(const OnlineLse<Acc>& seg, Acc row_max) {
  if (seg.arg == kNoCandidate || seg.max == static_cast<Acc>(-__builtin_huge_val())) return Acc(0);
  return seg.sum * vat_exp<Acc>(seg.max - row_max);
}

template <typename Elem, typename Acc, bool kSample, bool kScaled>
__global__ void vat_row_forward_kernel(const Elem* draft, const Elem* target, const int64_t* tokens,
                                       const float* uniforms, int64_t vocab, Acc inv_temperature, Acc* ce_soft,
                                       Acc* ce_hard, Acc* draft_lse, Acc* target_lse, float* accept) {
  DARTREE_SHARED_ARRAY(RowStats<Acc>, s_warps, 33);
  DARTREE_SHARED_ARRAY(Acc, s_before, 1);
  DARTREE_SHARED_ARRAY(int, s_found, 2);
  const int64_t row = blockIdx.x;
  const int v = static_cast<int>(vocab);
  const Elem* d_row = draft + row * vocab;
  const Elem* t_row = target + row * vocab;
  // Warp w reads the contiguous segment [w * seg, (w + 1) * seg) of the row, 32 consecutive
  // elements per step (coalesced), so its statistics after the warp merge are the segment's: the
  // sampling rule then scans only the one segment that holds the sample.
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = blockDim.x / warpSize;
  const int seg = ((v + warps - 1) / warps + warpSize - 1) / warpSize * warpSize;
  const int seg_begin = min_int(v, warp * seg), seg_end = min_int(v, seg_begin + seg);
  RowStats<Acc> mine{lse_empty<Acc>(), lse_empty<Acc>(), lse_empty<Acc>(), lse_empty<Acc>()};
  auto add = [&](Elem d_elem, Elem t_elem, int i) {
    const Acc d = static_cast<Acc>(to_float(d_elem));
    const Acc t = static_cast<Acc>(to_float(t_elem));
    lse_add<Acc, false>(mine.d, d, Acc(0), i);
    lse_add<Acc, true>(mine.t, t, d, i);
    if (kScaled) {
      lse_add<Acc, false>(mine.dt, d * inv_temperature, Acc(0), i);
      lse_add<Acc, false>(mine.tt, t * inv_temperature, Acc(0), i);
    }
  };
  // 16-byte vector loads where both rows are 16-byte aligned (segments start at multiples of 32
  // elements, so every lane's vector is aligned too): a lane takes Vec16<Elem>::kCount consecutive
  // elements per step; the rest of the segment, element by element. Each thread still meets its
  // indices in increasing order (the first maximum wins ties).
  int scalar_begin = seg_begin;
  if (aligned16(d_row) && aligned16(t_row)) {
    constexpr int kVec = Vec16<Elem>::kCount;
    const int step = kVec * warpSize;
    const int vec_end = seg_begin + (seg_end - seg_begin) / step * step;
    for (int i = seg_begin + lane * kVec; i < vec_end; i += step) {
      const Vec16<Elem> dv = load_vec16(d_row + i), tv = load_vec16(t_row + i);
      for (int k = 0; k < kVec; ++k) add(dv.v[k], tv.v[k], i + k);
    }
    scalar_begin = vec_end;
  }
  for (int i = scalar_begin + lane; i < seg_end; i += warpSize) add(d_row[i], t_row[i], i);
  const RowStats<Acc> all = block_merge_stats<Acc, kScaled>(mine, s_warps);
  const OnlineLse<Acc>& dq = kScaled ? all.dt : all.d;  // draft at temperature T
  const OnlineLse<Acc>& tp = kScaled ? all.tt : all.t;  // target at temperature T
  float accepted = all.d.arg == all.t.arg ? 1.0f : 0.0f;  // greedy rule
  if (kSample) {
    // inverse CDF of q_T: thread 0 finds the segment whose cumulative mass passes the goal, then
    // that segment's warp scans it 32 elements at a time (and on past its end, should rounding
    // put the goal there), with no block barrier inside the scan
    const Acc goal = static_cast<Acc>(uniforms[row * 2]) * dq.sum;
    if (threadIdx.x == 0) {
      Acc before = Acc(0);
      int first = kNoCandidate;
      for (int w = 0; w < warps; ++w) {
        const Acc mass = segment_mass<Acc>(kScaled ? s_warps[w].dt : s_warps[w].d, dq.max);
        if (mass > Acc(0) && before + mass > goal) {
          first = w;
          break;
        }
        before += mass;
      }
      s_found[0] = first;
      s_found[1] = kNoCandidate;
      s_before[0] = before;
    }
    __syncthreads();
    if (warp == s_found[0]) {
      Acc carry = s_before[0];
      int found = kNoCandidate;
      for (int base = seg_begin; base < v && found == kNoCandidate; base += warpSize) {
        const int i = base + lane;
        Acc e = Acc(0);
        if (i < v) {
          const Acc x = static_cast<Acc>(to_float(d_row[i])) * (kScaled ? inv_temperature : Acc(1));
          e = x == -__builtin_huge_val() ? Acc(0) : vat_exp<Acc>(x - dq.max);
        }
        Acc inclusive = e;
        for (int offset = 1; offset < warpSize; offset *= 2) {
          const Acc up = __shfl_up_sync(kFullWarpMask, inclusive, offset);
          if (lane >= offset) inclusive += up;
        }
        const unsigned hit = __ballot_sync(kFullWarpMask, i < v && e > Acc(0) && carry + inclusive > goal);
        if (hit != 0u) found = base + __ffs(static_cast<int>(hit)) - 1;
        carry += __shfl_sync(kFullWarpMask, inclusive, warpSize - 1);
      }
      if (lane == 0) s_found[1] = found;
    }
    __syncthreads();
    int chosen = s_found[1];
    if (chosen == kNoCandidate) chosen = all.d.arg;  // the goal fell past the summed total by rounding
    if (chosen < 0 || chosen >= v) chosen = 0;        // only for NaN rows: stay in bounds
    if (threadIdx.x == 0) {
      const Acc scale = kScaled ? inv_temperature : Acc(1);
      const Acc q = vat_exp<Acc>(static_cast<Acc>(to_float(d_row[chosen])) * scale - dq.max) / dq.sum;
      const Acc p = vat_exp<Acc>(static_cast<Acc>(to_float(t_row[chosen])) * scale - tp.max) / tp.sum;
      accepted = static_cast<Acc>(uniforms[row * 2 + 1]) * q < p ? 1.0f : 0.0f;
    }
  }
  if (threadIdx.x == 0) {
    const Acc lse_d = all.d.max + vat_log<Acc>(all.d.sum);
    const Acc lse_t = all.t.max + vat_log<Acc>(all.t.sum);
    const int64_t y = tokens[row];
    ce_soft[row] = lse_d - all.t.dot / all.t.sum;
    ce_hard[row] = (y >= 0 && y < vocab) ? lse_d - static_cast<Acc>(to_float(d_row[y]))
                                         : static_cast<Acc>(__builtin_nan(""));
    draft_lse[row] = lse_d;
    target_lse[row] = lse_t;
    accept[row] = accepted;
  }
}

template <typename Elem, typename Acc>
__global__ void vat_row_backward_kernel(const Elem* draft, const Elem* target, const int64_t* tokens,
                                        const Acc* draft_lse, const Acc* target_lse, const Acc* g_q, const Acc* g_p,
                                        const Acc* g_y, int64_t vocab, Elem* grad) {
  const int64_t row = blockIdx.x;
  const int v = static_cast<int>(vocab);
  const Acc cq = g_q[row], cp = g_p[row], cy = g_y[row];
  Elem* out = grad + row * vocab;
  if (cq == Acc(0) && cp == Acc(0) && cy == Acc(0)) {
    for (int i = threadIdx.x; i < v; i += blockDim.x) out[i] = FromFloat<Elem>::convert(Acc(0));
    return;
  }
  const Elem* d_row = draft + row * vocab;
  const Elem* t_row = target + row * vocab;
  const Acc lse_d = draft_lse[row], lse_t = target_lse[row];
  const int64_t y = tokens[row];
  for (int i = threadIdx.x; i < v; i += blockDim.x) {
    Acc g = cq * vat_exp<Acc>(static_cast<Acc>(to_float(d_row[i])) - lse_d);
    if (cp != Acc(0)) g -= cp * vat_exp<Acc>(static_cast<Acc>(to_float(t_row[i])) - lse_t);
    if (i == y) g -= cy;
    out[i] = FromFloat<Elem>::convert(g);
  }
}

// Weight of 1-based position k of a block whose first rejection is k_star (see VatSchedule). The
// decay is computed in double and rounded once to float, as the CPU kernel and the reference do, so
// every backend gets the same float (a device expf is not correctly rounded and differed by an ulp).
DARTREE_DEVICE float vat_weight(int schedule, int k, int k_star, double decay_gamma) {
  switch (static_cast<VatSchedule>(schedule)) {
    case VatSchedule::kVat:
      return k < k_star ? 1.0f : static_cast<float>(exp(-static_cast<double>(k - k_star) / decay_gamma));
    case VatSchedule::kDflash: return static_cast<float>(exp(-static_cast<double>(k - 1) / decay_gamma));
    case VatSchedule::kPrefixOnly: return k < k_star ? 1.0f : 0.0f;
    case VatSchedule::kHardCutoff: return k <= k_star ? 1.0f : 0.0f;
    default:  // kUnshifted
      return k < k_star ? 1.0f : static_cast<float>(exp(-static_cast<double>(k - 1) / decay_gamma));
  }
}

__global__ void vat_block_weights_kernel(const float* accept, const uint8_t* valid, int64_t blocks, int k,
                                         int schedule, double decay_gamma, int32_t* first_reject, float* weights) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= blocks) return;
  const float* acc = accept + m * k;
  const uint8_t* ok = valid + m * k;
  int k_star = k + 1;
  for (int j = 0; j < k; ++j) {
    if (ok[j] && acc[j] == 0.0f) {
      k_star = j + 1;
      break;
    }
  }
  first_reject[m] = k_star;
  for (int j = 0; j < k; ++j) weights[m * k + j] = ok[j] ? vat_weight(schedule, j + 1, k_star, decay_gamma) : 0.0f;
}

inline int vat_row_threads(int64_t vocab) {
  const int64_t warps = (vocab + 31) / 32;
  return warps >= kVatMaxThreads / 32 ? kVatMaxThreads : static_cast<int>(warps < 1 ? 32 : warps * 32);
}

template <typename Elem, typename Acc>
void launch_vat_row_forward_as(const void* draft, const void* target, const int64_t* tokens, const float* uniforms,
                               int64_t rows, int64_t vocab, double temperature, void* ce_soft, void* ce_hard,
                               void* draft_lse, void* target_lse, float* accept, cudaStream_t stream) {
  const Acc inv_t = static_cast<Acc>(1.0 / temperature);
  const bool sample = uniforms != nullptr, scaled = sample && temperature != 1.0;
  const dim3 grid(static_cast<unsigned>(rows)), block(static_cast<unsigned>(vat_row_threads(vocab)));
  const auto* d = static_cast<const Elem*>(draft);
  const auto* t = static_cast<const Elem*>(target);
  auto* soft = static_cast<Acc*>(ce_soft);
  auto* hard = static_cast<Acc*>(ce_hard);
  auto* lse_d = static_cast<Acc*>(draft_lse);
  auto* lse_t = static_cast<Acc*>(target_lse);
  if (!sample) {
    auto kernel = vat_row_forward_kernel<Elem, Acc, false, false>;
    DARTREE_LAUNCH(kernel, grid, block, 0, stream, d, t, tokens, uniforms, vocab, inv_t, soft, hard, lse_d, lse_t,
                   accept);
  } else if (!scaled) {
    auto kernel = vat_row_forward_kernel<Elem, Acc, true, false>;
    DARTREE_LAUNCH(kernel, grid, block, 0, stream, d, t, tokens, uniforms, vocab, inv_t, soft, hard, lse_d, lse_t,
                   accept);
  } else {
    auto kernel = vat_row_forward_kernel<Elem, Acc, true, true>;
    DARTREE_LAUNCH(kernel, grid, block, 0, stream, d, t, tokens, uniforms, vocab, inv_t, soft, hard, lse_d, lse_t,
                   accept);
  }
}

void launch_vat_row_forward(ElemType dtype, const void* draft, const void* target, const int64_t* tokens,
                            const float* uniforms, int64_t rows, int64_t vocab, double temperature, void* ce_soft,
                            void* ce_hard, void* draft_lse, void* target_lse, float* accept, cudaStream_t stream) {
  if (rows == 0) return;
  switch (dtype) {
    case ElemType::kFloat32:
      launch_vat_row_forward_as<float, float>(draft, target, tokens, uniforms, rows, vocab, temperature, ce_soft,
                                              ce_hard, draft_lse, target_lse, accept, stream);
      break;
    case ElemType::kBFloat16:
      launch_vat_row_forward_as<Bf16, float>(draft, target, tokens, uniforms, rows, vocab, temperature, ce_soft,
                                             ce_hard, draft_lse, target_lse, accept, stream);
      break;
    case ElemType::kFloat16:
      launch_vat_row_forward_as<Fp16, float>(draft, target, tokens, uniforms, rows, vocab, temperature, ce_soft,
                                             ce_hard, draft_lse, target_lse, accept, stream);
      break;
    default:
      launch_vat_row_forward_as<double, double>(draft, target, tokens, uniforms, rows, vocab, temperature, ce_soft,
                                                ce_hard, draft_lse, target_lse, accept, stream);
  }
}

template <typename Elem, typename Acc>
void launch_vat_row_backward_as(const void* draft, const void* target, const int64_t* tokens, const void* draft_lse,
                                const void* target_lse, const void* g_q, const void* g_p, const void* g_y,
                                int64_t rows, int64_t vocab, void* grad_draft, cudaStream_t stream) {
  auto kernel = vat_row_backward_kernel<Elem, Acc>;
  DARTREE_LAUNCH(kernel, dim3(static_cast<unsigned>(rows)), dim3(static_cast<unsigned>(vat_row_threads(vocab))), 0,
                 stream, static_cast<const Elem*>(draft), static_cast<const Elem*>(target), tokens,
                 static_cast<const Acc*>(draft_lse), static_cast<const Acc*>(target_lse), static_cast<const Acc*>(g_q),
                 static_cast<const Acc*>(g_p), static_cast<const Acc*>(g_y), vocab, static_cast<Elem*>(grad_draft));
}

void launch_vat_row_backward(ElemType dtype, const void* draft, const void* target, const int64_t* tokens,
                             const void* draft_lse, const void* target_lse, const void* g_q, const void* g_p,
                             const void* g_y, int64_t rows, int64_t vocab, void* grad_draft, cudaStream_t stream) {
  if (rows == 0) return;
  switch (dtype) {
    case ElemType::kFloat32:
      launch_vat_row_backward_as<float, float>(draft, target, tokens, draft_lse, target_lse, g_q, g_p, g_y, rows,
                                               vocab, grad_draft, stream);
      break;
    case ElemType::kBFloat16:
      launch_vat_row_backward_as<Bf16, float>(draft, target, tokens, draft_lse, target_lse, g_q, g_p, g_y, rows,
                                              vocab, grad_draft, stream);
      break;
    case ElemType::kFloat16:
      launch_vat_row_backward_as<Fp16, float>(draft, target, tokens, draft_lse, target_lse, g_q, g_p, g_y, rows,
                                              vocab, grad_draft, stream);
      break;
    default:
      launch_vat_row_backward_as<double, double>(draft, target, tokens, draft_lse, target_lse, g_q, g_p, g_y, rows,
                                                 vocab, grad_draft, stream);
  }
}

void launch_vat_block_weights(const float* accept, const uint8_t* valid, int64_t blocks, int k, int schedule,
                              double decay_gamma, int32_t* first_reject, float* weights, cudaStream_t stream) {
  if (blocks == 0) return;
  constexpr int kThreads = 128;
  const unsigned grid = static_cast<unsigned>((blocks + kThreads - 1) / kThreads);
  DARTREE_LAUNCH(vat_block_weights_kernel, dim3(grid), dim3(kThreads), 0, stream, accept, valid, blocks, k, schedule,
                 decay_gamma, first_reject, weights);
}

}  // namespace kernels
}  // namespace dartree
