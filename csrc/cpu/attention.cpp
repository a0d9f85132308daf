// CPU kernel for attention over a few query rows: the root + tree of a verification forward, or
// the one row of a plain decoding step, against a target's KV cache.
//
// out[b, h, t] = sum_j softmax_j(scale * q[b, h, t] . k[b, h / rep, j] + mask[b, 0, t, j]) v[b, h / rep, j]
//
// Row-invariant by construction: a query row's result depends only on that row, its mask row and
// the keys / values its mask leaves visible (mask > -1e30), taken in key order. Hidden keys are
// skipped, not added as zeros: softmax gives them weight exactly 0 in float32 whenever the row
// sees some key, so the result is that of the full formula, and it is the same bits
//   - whatever the number of query rows in the call and the row's place among them,
//   - whatever hidden keys sit between the visible ones (a tree node sees the committed prefix,
//     then only its ancestors among the tree's slots; the same token decoded plainly sees the
//     same keys, in the same order, with nothing between them).
// With few_rows_linear (also batch-invariant) this makes a tree verification round exactly as a
// plain step does, in bfloat16 too. Every reduction runs over 64-byte-aligned float32 buffers
// (the keys and values are widened or copied into them first), so vectorised code never splits a
// sum differently from one call to the next. A row whose mask hides every key falls back to the
// full formula over all keys (what SDPA computes for such a row); a row whose scores are all -inf
// (a mask of -inf everywhere) gives 0, as SDPA does.
//
// The work per (batch, key/value head, chunk of query rows) shares each key and value row among the query
// heads that read it (grouped-query attention without repeating the cache); those units run in
// parallel chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "vec_math.h"

namespace dartree {
namespace {

constexpr float kHidden = -1e30f;  // a mask value at or below this hides the key
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per key/value head
constexpr int64_t kAlign = 16;     // floats: 64 bytes

int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The transposed keys' row stride: at least n floats, an odd number of 64-byte lines. The score
// loop reads one line from each of d rows; rows a power-of-two number of lines apart (256 keys:
// 1 KiB) fall in a few L1 sets and evict each other on every block (4-5x slower from 248 to 256
// keys), while an odd number of lines spreads them over every set.
int64_t key_stride(int64_t n) {
  const int64_t padded = round_up(n);
  return (padded / kAlign) % 2 == 0 ? padded + kAlign : padded;
}

constexpr int64_t kLanes = 16;  // key columns / value columns per register block

// One unit of work: one (batch, key/value head), all its query rows.
struct Unit {
  const void* q;        // query rows of head (g * rep + r) at q + r * q_head_stride + t * q_row_stride
  int64_t q_head_stride, q_row_stride;
  const void* k;        // key / value row j at k + j * k_stride elements
  const void* v;
  int64_t k_stride, v_stride;
  const float* mask;    // mask row t at mask + t * mask_row_stride (stride mask_stride per key), or null
  int64_t mask_row_stride, mask_stride;
  void* out;            // output row (r, t) at out + r * out_head_stride + t * out_row_stride
  int64_t out_head_stride, out_row_stride;
  int64_t rep, rows, d, dv, slots, padded;
  float scale;
  float* keys_t;        // scratch [d, padded]: the keys transposed, as float32, zero columns past slots
  float* values;        // scratch [slots, dv_padded]: the values as float32
  int64_t dv_padded;
  float* scores;        // scratch [rep, padded]
  float* query;         // scratch [rep, d]
  float* acc;           // scratch [rep, dv_padded]
  float* inv;           // scratch [rep]: per query head of the current row, 1 / the softmax's sum
  int64_t* visible;     // scratch [slots]
};

// 8 float32 lanes (GCC vector extension: one AVX register in the AVX2 clone, two SSE ones in the
// baseline); loads and stores from 32-byte-aligned scratch.
// (-Wpsabi: these inline helpers never cross an ABI boundary, whatever build they land in)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Vec8 __attribute__((vector_size(32)));
DARTREE_VEC_INLINE Vec8 load8(const float* p) { return *reinterpret_cast<const Vec8*>(__builtin_assume_aligned(p, 32)); }
DARTREE_VEC_INLINE void store8(float* p, Vec8 x) { *reinterpret_cast<Vec8*>(__builtin_assume_aligned(p, 32)) = x; }

template <typename T>
DARTREE_VEC_INLINE float widen(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {  // bfloat16 bits: exact
    return bf16_float(x);
  }
}

template <typename T>
DARTREE_VEC_INLINE void store(T* dst, float x) {
  if constexpr (std::is_same_v<T, float>) {
    *dst = x;
  } else {
    *dst = c10::BFloat16(x).x;  // round to nearest even
  }
}

// Scores of G query rows (float32, `d` apart) against the 16 key columns at kt (the transposed
// keys, `padded` apart): each lane sums q[c] * k[j][c] over c in order.
template <int G>
DARTREE_VEC_INLINE void score_block(const float* q, int64_t d, const float* kt, int64_t padded, float* out,
                                    int64_t out_stride) {
  Vec8 a[G][2] = {};
  for (int64_t c = 0; c < d; ++c, kt += padded) {
    const Vec8 k0 = load8(kt), k1 = load8(kt + 8);
    for (int g = 0; g < G; ++g) {
      const float qc = q[g * d + c];
      a[g][0] += qc * k0;
      a[g][1] += qc * k1;
    }
  }
  for (int g = 0; g < G; ++g) {
    store8(out + g * out_stride, a[g][0]);
    store8(out + g * out_stride + 8, a[g][1]);
  }
}

// sum_i p[g][i] * values[visible[i]][cb .. cb + 16) for G rows (weights `p_stride` apart): over
// the visible keys in order.
template <int G>
DARTREE_VEC_INLINE void weigh_block(const float* p, int64_t p_stride, const float* values, int64_t stride,
                                    const int64_t* visible, int64_t n, float* out, int64_t out_stride) {
  Vec8 a[G][2] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float* vf = values + visible[i] * stride;
    const Vec8 v0 = load8(vf), v1 = load8(vf + 8);
    for (int g = 0; g < G; ++g) {
      const float w = p[g * p_stride + i];
      a[g][0] += w * v0;
      a[g][1] += w * v1;
    }
  }
  for (int g = 0; g < G; ++g) {
    store8(out + g * out_stride, a[g][0]);
    store8(out + g * out_stride + 8, a[g][1]);
  }
}

constexpr int kGroup = 4;  // query rows per register block (4 x 2 accumulators)

// f(std::integral_constant<int, g>) for g in 1 .. kGroup: the block functions' row count as a constant
template <typename F>
DARTREE_VEC_INLINE void by_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, kGroup>{}); break;
  }
}

// T: float, or uint16_t holding bfloat16 bits. Inlined into each build below.
//
// Scores: 16 key columns at a time, each lane summing q[c] * k[j][c] over c in order (the same
// instructions for every key, wherever it sits in the cache, whichever rows share the block).
// Softmax and the weighted sum of the values: over the row's visible keys in key order (a sum's
// lanes follow the position in that list, the same for a tree node as for the plain step that
// decodes the same token).
template <typename T>
DARTREE_VEC_INLINE void attend_unit(const Unit& u) {
  const int64_t rep = u.rep, d = u.d, dv = u.dv, padded = u.padded, slots = u.slots, dvp = u.dv_padded;
  const T* keys = static_cast<const T*>(u.k);
  const T* vals = static_cast<const T*>(u.v);
  for (int64_t j = 0; j < slots; ++j) {
    const T* kr = keys + j * u.k_stride;
    for (int64_t c = 0; c < d; ++c) u.keys_t[c * padded + j] = widen(kr[c]);
    const T* vr = vals + j * u.v_stride;
    float* vf = u.values + j * dvp;
    for (int64_t c = 0; c < dv; ++c) vf[c] = widen(vr[c]);
    for (int64_t c = dv; c < dvp; ++c) vf[c] = 0.0f;
  }
  for (int64_t c = 0; c < d; ++c)
    for (int64_t j = slots; j < round_up(slots); ++j) u.keys_t[c * padded + j] = 0.0f;
  const T* qs = static_cast<const T*>(u.q);
  T* os = static_cast<T*>(u.out);
  for (int64_t t = 0; t < u.rows; ++t) {
    const float* mrow = u.mask ? u.mask + t * u.mask_row_stride : nullptr;
    int64_t n = 0;
    for (int64_t j = 0; j < slots; ++j)
      if (!mrow || mrow[j * u.mask_stride] > kHidden) u.visible[n++] = j;
    if (n == 0)  // every key hidden: the full formula over all keys
      for (int64_t j = 0; j < slots; ++j) u.visible[n++] = j;
    for (int64_t r = 0; r < rep; ++r) {
      const T* qr = qs + r * u.q_head_stride + t * u.q_row_stride;
      for (int64_t c = 0; c < d; ++c) u.query[r * d + c] = widen(qr[c]);
    }
    for (int64_t r0 = 0; r0 < rep; r0 += kGroup) {
      const int64_t g = std::min<int64_t>(kGroup, rep - r0);
      const float* q = u.query + r0 * d;
      float* sc = u.scores + r0 * padded;
      for (int64_t jb = 0; jb < round_up(slots); jb += kLanes) {
        by_group(g, [&](auto group) { score_block<group()>(q, d, u.keys_t + jb, padded, sc + jb, padded); });
      }
    }
    for (int64_t r = 0; r < rep; ++r) {
      float* sc = u.scores + r * padded;
      // the visible keys' scores, packed in key order (in place: visible[i] >= i)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = u.visible[i];
        sc[i] = sc[j] * u.scale + (mrow ? mrow[j * u.mask_stride] : 0.0f);
      }
      float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)  // (the maximum is the same whatever the order)
      for (int64_t i = 0; i < n; ++i) top = sc[i] > top ? sc[i] : top;
      if (top == -std::numeric_limits<float>::infinity()) {  // every score -inf: 0, as SDPA gives
        for (int64_t i = 0; i < n; ++i) sc[i] = 0.0f;
        u.inv[r] = 0.0f;
        continue;
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sc[i] = vexp(sc[i] - top);
        sum += sc[i];
      }
      u.inv[r] = 1.0f / sum;
    }
    for (int64_t r0 = 0; r0 < rep; r0 += kGroup) {
      const int64_t g = std::min<int64_t>(kGroup, rep - r0);
      const float* p = u.scores + r0 * padded;
      float* acc = u.acc + r0 * dvp;
      for (int64_t cb = 0; cb < dv; cb += kLanes) {
        by_group(g, [&](auto group) { weigh_block<group()>(p, padded, u.values + cb, dvp, u.visible, n, acc + cb, dvp); });
      }
    }
    for (int64_t r = 0; r < rep; ++r) {
      T* orow = os + r * u.out_head_stride + t * u.out_row_stride;
      const float* acc = u.acc + r * dvp;
      for (int64_t c = 0; c < dv; ++c) store(orow + c, acc[c] * u.inv[r]);
    }
  }
}

// Two builds of each: AVX2 + FMA, chosen at run time where the CPU has them (cpu_has_avx2_fma),
// and the baseline x86-64. Both give the same results on one machine for every call, which is what row
// invariance needs; they differ from each other in rounding (FMA contraction).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define DARTREE_ATTENTION_AVX2 1
__attribute__((target("avx2,fma"))) void attend_unit_f32_avx2(const Unit& u) { attend_unit<float>(u); }
__attribute__((target("avx2,fma"))) void attend_unit_bf16_avx2(const Unit& u) { attend_unit<uint16_t>(u); }
#endif
void attend_unit_f32_base(const Unit& u) { attend_unit<float>(u); }
void attend_unit_bf16_base(const Unit& u) { attend_unit<uint16_t>(u); }

template <typename T>
void attend(const Unit& u) {
#ifdef DARTREE_ATTENTION_AVX2
  if (cpu_has_avx2_fma()) {
    if constexpr (std::is_same_v<T, float>) {
      attend_unit_f32_avx2(u);
    } else {
      attend_unit_bf16_avx2(u);
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    attend_unit_f32_base(u);
  } else {
    attend_unit_bf16_base(u);
  }
}

template <typename T>
void attention_units(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                     float scale, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), slots = key.size(2), dv = value.size(3), rep = heads / kv_heads;
  const T* q = static_cast<const T*>(query.data_ptr());
  const T* k = static_cast<const T*>(key.data_ptr());
  const T* v = static_cast<const T*>(value.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  const float* m = mask.defined() ? mask.data_ptr<float>() : nullptr;
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides(), os = out.strides();
  const int64_t heads_units = batch * kv_heads, padded = key_stride(slots), dv_padded = round_up(dv);
  // Few (batch, key/value head) units and several rows: each unit's rows split in chunks, so the
  // threads share the work evenly (each chunk widens its head's keys again; rows stay independent).
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = heads_units < 2 * threads && rows >= 8
                             ? std::min<int64_t>((2 * threads + heads_units - 1) / heads_units, rows / 4)
                             : 1;
  const int64_t per_chunk = (rows + chunks - 1) / chunks, units = heads_units * chunks;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scratch = at::empty({d * padded + slots * dv_padded + rep * padded + round_up(rep * d) + rep * dv_padded + kAlign},
                                   at::TensorOptions().dtype(at::kFloat));
    std::vector<int64_t> visible(slots);
    Unit u{};
    u.q_head_stride = qs[1];
    u.q_row_stride = qs[2];
    u.k_stride = ks[2];
    u.v_stride = vs[2];
    u.mask_row_stride = m ? mask.stride(2) : 0;
    u.mask_stride = m ? mask.stride(3) : 0;
    u.out_head_stride = os[1];
    u.out_row_stride = os[2];
    u.rep = rep;
    u.d = d;
    u.dv = dv;
    u.slots = slots;
    u.padded = padded;
    u.dv_padded = dv_padded;
    u.scale = scale;
    u.keys_t = scratch.data_ptr<float>();
    TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(u.keys_t) % 64 == 0, "few_rows_attention: scratch not 64-byte aligned");
    u.values = u.keys_t + d * padded;
    u.scores = u.values + slots * dv_padded;
    u.query = u.scores + rep * padded;
    u.acc = u.query + round_up(rep * d);
    u.inv = u.acc + rep * dv_padded;
    u.visible = visible.data();
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t c = unit % chunks, g = (unit / chunks) % kv_heads, b = unit / (chunks * kv_heads);
      const int64_t t0 = c * per_chunk;
      u.rows = std::min(rows, t0 + per_chunk) - t0;
      if (u.rows <= 0) continue;
      u.q = q + b * qs[0] + g * rep * qs[1] + t0 * qs[2];
      u.out = o + b * os[0] + g * rep * os[1] + t0 * os[2];
      u.k = k + b * ks[0] + g * ks[1];
      u.v = v + b * vs[0] + g * vs[1];
      u.mask = m ? m + b * mask.stride(0) + t0 * mask.stride(2) : nullptr;
      attend<T>(u);
    }
  });
}

at::Tensor few_rows_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const std::optional<at::Tensor>& mask, double scale) {
  constexpr const char* op = "few_rows_attention";
  TORCH_CHECK_VALUE(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op,
                    ": query [B, H, T, D], key [B, H_kv, S, D] and value [B, H_kv, S, Dv] expected, got ",
                    query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  TORCH_CHECK_VALUE(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), op,
                    ": CPU tensors only");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(key.scalar_type() == dtype && value.scalar_type() == dtype, op,
                    ": query, key and value must share a dtype, got ", dtype, ", ", key.scalar_type(), ", ",
                    value.scalar_type());
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), slots = key.size(2), dv = value.size(3);
  TORCH_CHECK_VALUE(key.size(0) == batch && value.size(0) == batch && value.size(1) == kv_heads &&
                        value.size(2) == slots && key.size(3) == d,
                    op, ": key / value do not match the query: ", query.sizes(), ", ", key.sizes(), ", ",
                    value.sizes());
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, op, ": ", heads,
                    " query heads over ", kv_heads, " key/value heads (at most ", kMaxGroup, " per group)");
  TORCH_CHECK_VALUE(d >= 1 && d <= kMaxHeadDim && dv >= 1 && dv <= kMaxHeadDim, op, ": head dims must be in [1, ",
                    kMaxHeadDim, "], got ", d, " and ", dv);
  TORCH_CHECK_VALUE(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, op,
                    ": the last dim of query, key and value must be contiguous");
  at::Tensor m;
  if (mask.has_value()) {
    const at::Tensor& given = *mask;
    TORCH_CHECK_VALUE(given.dim() == 4 && given.size(1) == 1 && (given.size(0) == 1 || given.size(0) == batch) &&
                          (given.size(2) == 1 || given.size(2) == rows) && given.size(3) == slots,
                      op, ": mask must be additive [B or 1, 1, T or 1, S] = [.., 1, ", rows, ", ", slots, "], got ",
                      given.sizes());
    TORCH_CHECK_VALUE(given.is_floating_point() && given.device().is_cpu(), op,
                      ": mask must be a floating-point CPU tensor (0 visible, a large negative value hidden)");
    m = given.to(at::kFloat).expand({batch, 1, rows, slots});
  }
  at::Tensor out = at::empty({batch, heads, rows, dv}, query.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK_VALUE(slots > 0, op, ": key and value hold no positions (S = 0): no keys to attend to");
  if (dtype == at::kFloat) {
    attention_units<float>(query, key, value, m, static_cast<float>(scale), out);
  } else {
    attention_units<uint16_t>(query, key, value, m, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) { m.impl("few_rows_attention", &few_rows_attention_cpu); }

}  // namespace dartree
