// CPU kernel for a linear layer over a few rows: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), the
// shape of a verification forward (M = root + tree nodes, at most a few dozen) through a target's
// weights. Each block of 4 weight rows (2 with AVX2) is read once per call and dotted with all M
// rows of x (in blocks of 6; 3 or 2 with AVX2; from L1/L2), accumulating in float32.
//
// Every output element is computed by the same instruction sequence whatever M, N and the row's
// place in the batch: its own accumulator over K in fixed chunks (16 float32 FMA lanes with
// AVX-512 or as two 8-lane halves with AVX2, the same bits; bfloat16 weights widened exactly first;
// a 16-lane scalar loop elsewhere), then a fixed
// reduction. So row m of the output is bit-identical to the output for x[m:m+1] alone (batch
// invariance): a tree verification rounds like a plain step through these layers, which a library
// GEMM (its blocking and kernels change with M) does not promise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>

#include "reduce16.h"
#define DARTREE_AVX512_LINEAR 1
#endif

namespace dartree {
namespace {

constexpr int64_t kMaxRows = 256;  // more rows than this: use a GEMM (the op checks)

template <typename T>
struct Problem {
  const T* x;
  const float* x32;   // bfloat16, AVX-512 path: x widened to float32 once per call (interleave_x)
  const T* w;
  const float* bias;  // float32 copy of the bias, or nullptr
  T* y;
  int64_t rows, in, out;
};

template <typename T>
void store(T* y, float value) {
  y[0] = static_cast<T>(value);  // bfloat16: round to nearest even
}

// Portable path: per output element, 16 partial sums over K in index order, then summed in a fixed
// order. Slower than the AVX-512 paths; the same numbers for a row whatever the batch.
template <typename T>
void linear_generic(const Problem<T>& p, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* w = p.w + n * p.in;
    for (int64_t m = 0; m < p.rows; ++m) {
      const T* x = p.x + m * p.in;
      float lanes[16] = {};
      for (int64_t k = 0; k < p.in; ++k) lanes[k % 16] += static_cast<float>(x[k]) * static_cast<float>(w[k]);
      float sum = 0.0f;
      for (float v : lanes) sum += v;
      if (p.bias != nullptr) sum += p.bias[n];
      store(p.y + m * p.out + n, sum);
    }
  }
}

#ifdef DARTREE_AVX512_LINEAR

// reduce16 (reduce16.h) sums an accumulator's 16 lanes in a fixed order: halves pairwise (8, 4, 2, 1).
// (GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm*_undefined_* placeholders, GCC
// bug 105593; the pragmas silence that, not a real use of an undefined value.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// One K step of an NB x MB register block: NB weight chunks, then each input chunk against all of
// them. LOAD(ptr) loads one chunk (masked at the tail); FMA(acc, x, w) accumulates into a lane set.
// Every loop here has compile-time bounds and is fully unrolled, so the accumulators stay in
// registers.
#define DARTREE_LINEAR_STEP(VEC, LOAD, FMA)                                        \
  {                                                                                \
    VEC w[NB];                                                                     \
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) w[i] = LOAD(wp[i] + k);   \
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {                         \
      const VEC x = LOAD(xp[j] + k);                                               \
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = FMA(acc[i][j], x, w[i]); \
    }                                                                              \
  }

// NB weight rows x MB input rows: NB * MB accumulators over K, 16 float32 lanes each.
template <int NB, int MB>
__attribute__((target("avx512f"))) void block_f32(const Problem<float>& p, int64_t n0, int64_t m0) {
  __m512 acc[NB][MB];
  const float* wp[NB];
  const float* xp[MB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = p.w + (n0 + i) * p.in;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = p.x + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = p.in / 16 * 16;
  // The first pass over this block's rows streams them from memory: fetch the next block's rows
  // meanwhile, a cache line per row a step (a hint: never faults, harmless past the matrix). On a
  // 2-vCPU Xeon this halved the time at 1 row and cut it by a third at 16 (bench/linear_speed.py).
  const int64_t ahead = m0 == 0 && n0 + 2 * NB <= p.out ? NB * p.in : 0;  // (none past the last block)
#define DARTREE_FMA_F32(acc, x, w) _mm512_fmadd_ps(x, w, acc)
  int64_t k = 0;
  for (; k < full; k += 16) {
    if (ahead != 0) {
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wp[i] + ahead + k), _MM_HINT_T0);
    }
#define DARTREE_LOAD(ptr) _mm512_loadu_ps(ptr)
    DARTREE_LINEAR_STEP(__m512, DARTREE_LOAD, DARTREE_FMA_F32)
#undef DARTREE_LOAD
  }
  if (k < p.in) {  // the tail, zero-filled: adds exact zeros
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.in - k)) - 1);
#define DARTREE_LOAD(ptr) _mm512_maskz_loadu_ps(mask, ptr)
    DARTREE_LINEAR_STEP(__m512, DARTREE_LOAD, DARTREE_FMA_F32)
#undef DARTREE_LOAD
  }
#undef DARTREE_FMA_F32
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      p.y[(m0 + j) * p.out + n0 + i] = sum;
    }
}

// The same for bfloat16 weights, widened to float32 in registers (exact: a shift or a mask),
// against x widened to float32 once per call; float32 FMA; the sum rounded to bfloat16 once, at
// the end. Each 32 weights (one 512-bit load) give two float32 vectors with one instruction each:
// the even-indexed elements (each 32-bit word shifted left by 16) and the odd-indexed ones (the
// word's low half cleared). x32 holds every 32 inputs in the same order (16 even, then 16 odd:
// `interleave_x`), so both vectors meet their inputs with no shuffle. That halves the widening
// work of a 16-element zero-extend + shift, which competes with the FMAs for the same ports. A K
// tail of fewer than 32 is widened 16 at a time, masked. Each lane takes the odd-indexed product
// first, then the even one: the order of VDPBF16PS (block_bf16_dot), so the two give the same bits.
#define DARTREE_WIDEN_BF16(ptr) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(ptr))), 16))
#define DARTREE_WIDEN_BF16_MASKED(ptr) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, ptr)), 16))
// x as block_bf16 reads it (float32) or as block_bf16_dot does (bfloat16, widened exactly here)
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 load_x16(const float* x) {
  return _mm512_loadu_ps(x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 load_x16(const uint16_t* x) {
  return DARTREE_WIDEN_BF16(x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 load_x16(const float* x,
                                                                                           __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 load_x16(const uint16_t* x,
                                                                                           __mmask16 mask) {
  return DARTREE_WIDEN_BF16_MASKED(x);
}

// The bfloat16 K tail past the last full 32-block, from k: plain order, 16 at a time (the last
// masked), weights widened exactly; the same for the FMA and the VDPBF16PS paths.
template <int NB, int MB, typename X>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void bf16_tail(
    __m512 (&acc)[NB][MB], const uint16_t* const* wp, const X* const* xp, int64_t k, int64_t in) {
  for (; k + 16 <= in; k += 16) {  // at most one: the tail of 16..31
    __m512 w[NB];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) w[i] = DARTREE_WIDEN_BF16(wp[i] + k);
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const __m512 x = load_x16(xp[j] + k);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(x, w[i], acc[i][j]);
    }
  }
  if (k < in) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (in - k)) - 1);
    __m512 w[NB];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) w[i] = DARTREE_WIDEN_BF16_MASKED(wp[i] + k);
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const __m512 x = load_x16(xp[j] + k, mask);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(x, w[i], acc[i][j]);
    }
  }
}

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_bf16(const Problem<c10::BFloat16>& p, int64_t n0,
                                                                         int64_t m0) {
  __m512 acc[NB][MB];
  const uint16_t* wp[NB];
  const float* xp[MB];
  const auto* wb = reinterpret_cast<const uint16_t*>(p.w);
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = wb + (n0 + i) * p.in;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = p.x32 + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = p.in / 32 * 32;
  // Every pass over this block's rows fetches the next block's (block_f32 and the AVX2 kernels do
  // it in the first pass only). In bfloat16 a pass is short, and prefetching only in the first of
  // several (more input rows than one register block) left the memory idle in the others: on a
  // 2-vCPU Zen 4 EPYC, SmolLM2-135M's 211 linear layers took 19.1-21.5 ms at 12 rows against
  // 16.2-16.8 with every pass prefetching, 22.4-26.7 against 17.9-18.4 at 16 (a repeated line is
  // in flight or cached: cheap); 1-6 rows (one pass) are unchanged (bench/forward_speed.py
  // --layers; docs/results/prefetch_passes_zen4.md). One-off timings of float32 and of the AVX2
  // kernels moved nothing beyond noise, so they keep the first-pass prefetch. The last block has
  // no next block to fetch (no pointer past the weights is formed).
  const int64_t ahead = n0 + 2 * NB <= p.out ? NB * p.in : 0;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k < pairs; k += 32) {
    __m512 even[NB], odd[NB];
    if (ahead != 0) {
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wp[i] + ahead + k), _MM_HINT_T0);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
      const __m512i raw = _mm512_loadu_si512(wp[i] + k);
      even[i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      odd[i] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {  // odd first: VDPBF16PS's order (block_bf16_dot)
      const __m512 xo = _mm512_loadu_ps(xp[j] + k + 16);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(xo, odd[i], acc[i][j]);
      const __m512 xe = _mm512_loadu_ps(xp[j] + k);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(xe, even[i], acc[i][j]);
    }
  }
  bf16_tail<NB, MB>(acc, wp, xp, k, p.in);
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      store(p.y + (m0 + j) * p.out + n0 + i, sum);
    }
}
// The same arithmetic with AVX-512 BF16's VDPBF16PS, where it runs faster than the FMAs above
// (dot_path_pays): one instruction takes 32 bfloat16 weights against 32 bfloat16 inputs as they
// are (no widening, and x is read as bfloat16, not widened once per call), and adds to each
// float32 lane its odd-indexed product, rounded, then its even-indexed one, rounded (Intel's
// definition; each product of two bfloat16 values is exact in float32). That is block_bf16's FMA
// pair lane for lane, so both give the same bits, except that VDPBF16PS treats subnormal inputs
// and results as zero (a product below 2^-126, which a model's weights and activations do not
// reach in practice). A K tail of fewer than 32 is widened and FMA'd exactly as block_bf16 does.
template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void block_bf16_dot(
    const Problem<c10::BFloat16>& p, int64_t n0, int64_t m0) {
  __m512 acc[NB][MB];
  const uint16_t* wp[NB];
  const uint16_t* xp[MB];
  const auto* wb = reinterpret_cast<const uint16_t*>(p.w);
  const auto* xb = reinterpret_cast<const uint16_t*>(p.x);
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = wb + (n0 + i) * p.in;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = xb + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = p.in / 32 * 32;
  const int64_t ahead = n0 + 2 * NB <= p.out ? NB * p.in : 0;  // every pass: see block_bf16
  int64_t k = 0;
  for (; k < pairs; k += 32) {
    __m512bh w[NB];
    if (ahead != 0) {
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wp[i] + ahead + k), _MM_HINT_T0);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) w[i] = (__m512bh)_mm512_loadu_si512(wp[i] + k);
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(xp[j] + k);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[i]);
    }
  }
  bf16_tail<NB, MB>(acc, wp, xp, k, p.in);
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      store(p.y + (m0 + j) * p.out + n0 + i, sum);
    }
}

// Whether VDPBF16PS adds more products per second than float32 FMAs on this CPU, measured once: 8
// independent chains of 16384 steps each (about 50-100 us), best of 5 interleaved timings, so a
// preemption or a clock ramp during one timing cannot decide it. It does by about 1.7x on a 2-vCPU AMD
// EPYC (Zen 4); on a Xeon with AVX-512 BF16 it issues at half the FMA rate, where the FMA path
// measured 10-15% faster. Both give the same bits, so only the speed depends on the answer.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline)) double dot_chain_seconds(bool dot) {
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(0x3f803f80);  // bfloat16 1.0 twice
  const __m512 unit = _mm512_set1_ps(1.0f), step = _mm512_set1_ps(1e-3f);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < 16384; ++r) {
    if (dot) {
      for (auto& a : acc) a = _mm512_dpbf16_ps(a, (__m512bh)one, (__m512bh)one);
    } else {
      for (auto& a : acc) a = _mm512_fmadd_ps(a, unit, step);
    }
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[7]));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink[16];
  _mm512_storeu_ps(sink, _mm512_add_ps(acc[0], acc[7]));
  __asm__ volatile("" : : "r"(sink) : "memory");
  return seconds;
}

bool dot_path_pays() {
  double dot = 1e9, fma = 1e9;
  for (int r = 0; r < 5; ++r) {
    fma = std::min(fma, dot_chain_seconds(false));
    dot = std::min(dot, dot_chain_seconds(true));
  }
  // products per second: 32 per VDPBF16PS, 16 per FMA; take it only for a clear gain
  return 32.0 / dot > 1.25 * (16.0 / fma);
}

#undef DARTREE_WIDEN_BF16
#undef DARTREE_WIDEN_BF16_MASKED
#undef DARTREE_LINEAR_STEP
#pragma GCC diagnostic pop

// Register blocks: NB weight rows x MB input rows, NB * MB float32 accumulators. 4 x 6 (24 of
// the 32 vector registers, with 4 weight vectors and an input) measured fastest on a 2-vCPU Xeon;
// 3 x 8 and 2 x 12 (one pass over the weights up to 8 or 12 rows) were slower past 8 rows.
constexpr int kRowBlock = 4;  // weight rows per register block
constexpr int kInBlock = 6;   // input rows per register block

// Dot: bfloat16 through VDPBF16PS (block_bf16_dot) instead of FMAs (block_bf16); the same bits.
template <typename T, int NB, int MB, bool Dot>
void block_of(const Problem<T>& p, int64_t n0, int64_t m0) {
  if constexpr (std::is_same_v<T, float>) {
    block_f32<NB, MB>(p, n0, m0);
  } else if constexpr (Dot) {
    block_bf16_dot<NB, MB>(p, n0, m0);
  } else {
    block_bf16<NB, MB>(p, n0, m0);
  }
}

template <typename T, int NB, bool Dot>
void block(const Problem<T>& p, int64_t n0, int64_t m0, int mb) {
  static_assert(kInBlock == 6, "the cases below go up to kInBlock");
  switch (mb) {
    case 1: return block_of<T, NB, 1, Dot>(p, n0, m0);
    case 2: return block_of<T, NB, 2, Dot>(p, n0, m0);
    case 3: return block_of<T, NB, 3, Dot>(p, n0, m0);
    case 4: return block_of<T, NB, 4, Dot>(p, n0, m0);
    case 5: return block_of<T, NB, 5, Dot>(p, n0, m0);
    default: return block_of<T, NB, 6, Dot>(p, n0, m0);
  }
}

// Weight rows [n_begin, n_end): blocks of 4 rows (single rows at the end) against blocks of up to
// 6 input rows. Which block an element falls in changes only how many accumulators run side by
// side, never the operations on one accumulator.
template <typename T, bool Dot = false>
void linear_avx512(const Problem<T>& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kRowBlock <= n_end; n += kRowBlock)
    for (int64_t m = 0; m < p.rows; m += kInBlock)
      block<T, kRowBlock, Dot>(p, n, m, static_cast<int>(std::min<int64_t>(kInBlock, p.rows - m)));
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < p.rows; m += kInBlock)
      block<T, 1, Dot>(p, n, m, static_cast<int>(std::min<int64_t>(kInBlock, p.rows - m)));
}

// The AVX2 + FMA path (x86 CPUs without AVX-512): the same arithmetic as the AVX-512 path, lane
// for lane. Each 16-lane accumulator is a pair of 8-lane registers (lanes 0..7 and 8..15), every
// lane sees the same FMAs over the same K indices in the same order, and the 16 lanes are summed
// in reduce16's order (halves pairwise, 8, 4, 2, 1). So the outputs are bit-identical to the
// AVX-512 path's (test_linear.py checks it where both run) and batch-invariant like it. With 16
// vector registers the blocks are smaller: 2 weight rows x 3 input rows for float32 (12
// accumulator registers), 2 x 2 for bfloat16 (8, with the widened weights beside them).
__attribute__((target("avx2,fma"), always_inline)) inline float reduce16_avx2(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// One 16-wide K step of an NB x MB float32 block: each half (lanes 0..7, 8..15) loads its NB
// weight chunks, then each input chunk against all of them.
template <int NB, int MB>
__attribute__((target("avx2,fma"), always_inline)) inline void step_f32_avx2(__m256 (&acc)[NB][MB][2],
                                                                            const float* const* w_rows,
                                                                            const float* const* x_rows, int64_t k) {
  _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
    __m256 w[NB];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) w[i] = _mm256_loadu_ps(w_rows[i] + k + 8 * h);
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const __m256 x = _mm256_loadu_ps(x_rows[j] + k + 8 * h);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j][h] = _mm256_fmadd_ps(x, w[i], acc[i][j][h]);
    }
  }
}

template <int NB, int MB>
__attribute__((target("avx2,fma"))) void block_f32_avx2(const Problem<float>& p, int64_t n0, int64_t m0) {
  __m256 acc[NB][MB][2];
  const float* wp[NB];
  const float* xp[MB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = p.w + (n0 + i) * p.in;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = p.x + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t full = p.in / 16 * 16;
  const int64_t ahead = m0 == 0 && n0 + 2 * NB <= p.out ? NB * p.in : 0;  // see block_f32
  int64_t k = 0;
  for (; k < full; k += 16) {
    if (ahead != 0) {
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wp[i] + ahead + k), _MM_HINT_T0);
    }
    step_f32_avx2<NB, MB>(acc, wp, xp, k);
  }
  if (k < p.in) {  // the tail, copied into zero-filled chunks: adds exact zeros, as the masked loads do
    const int64_t tail = p.in - k;
    alignas(32) float wt[NB][16] = {}, xt[MB][16] = {};
    const float* wr[NB];
    const float* xr[MB];
    for (int i = 0; i < NB; ++i) {
      std::copy(wp[i] + k, wp[i] + k + tail, wt[i]);
      wr[i] = wt[i];
    }
    for (int j = 0; j < MB; ++j) {
      std::copy(xp[j] + k, xp[j] + k + tail, xt[j]);
      xr[j] = xt[j];
    }
    step_f32_avx2<NB, MB>(acc, wr, xr, 0);
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16_avx2(acc[i][j][0], acc[i][j][1]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      p.y[(m0 + j) * p.out + n0 + i] = sum;
    }
}

// bfloat16 weights as block_bf16 widens them: a 32-weight block is two 16-weight halves, each
// giving its even-indexed elements (lanes 0..7 of the low half, 8..15 of the high half of the
// AVX-512 path's even vector) and its odd-indexed ones, against x32 in interleave_x's order.
template <int NB, int MB>
__attribute__((target("avx2,fma"))) void block_bf16_avx2(const Problem<c10::BFloat16>& p, int64_t n0, int64_t m0) {
  __m256 acc[NB][MB][2];
  const uint16_t* wp[NB];
  const float* xp[MB];
  const auto* wb = reinterpret_cast<const uint16_t*>(p.w);
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = wb + (n0 + i) * p.in;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = p.x32 + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t pairs = p.in / 32 * 32;
  const int64_t ahead = m0 == 0 && n0 + 2 * NB <= p.out ? NB * p.in : 0;  // see block_f32
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k < pairs; k += 32) {
    if (ahead != 0) {
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wp[i] + ahead + k), _MM_HINT_T0);
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      __m256 even[NB], odd[NB];
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[i] + k + 16 * h));
        even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        odd[i] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      }
      _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {  // odd first, as block_bf16
        const __m256 xo = _mm256_loadu_ps(xp[j] + k + 16 + 8 * h);
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j][h] = _mm256_fmadd_ps(xo, odd[i], acc[i][j][h]);
        const __m256 xe = _mm256_loadu_ps(xp[j] + k + 8 * h);
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j][h] = _mm256_fmadd_ps(xe, even[i], acc[i][j][h]);
      }
    }
  }
  // the tail of fewer than 32, in plain order 16 at a time (zero-filled past the end)
  for (; k < p.in; k += 16) {
    const int64_t len = std::min<int64_t>(16, p.in - k);
    alignas(32) uint16_t wt[NB][16] = {};
    alignas(32) float xt[MB][16] = {};
    for (int i = 0; i < NB; ++i) std::copy(wp[i] + k, wp[i] + k + len, wt[i]);
    for (int j = 0; j < MB; ++j) std::copy(xp[j] + k, xp[j] + k + len, xt[j]);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      __m256 w[NB];
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
        w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(wt[i] + 8 * h))), 16));
      _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
        const __m256 x = _mm256_load_ps(xt[j] + 8 * h);
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) acc[i][j][h] = _mm256_fmadd_ps(x, w[i], acc[i][j][h]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16_avx2(acc[i][j][0], acc[i][j][1]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      store(p.y + (m0 + j) * p.out + n0 + i, sum);
    }
}

template <typename T, int NB, int MB>
void block_of_avx2(const Problem<T>& p, int64_t n0, int64_t m0) {
  if constexpr (std::is_same_v<T, float>) {
    block_f32_avx2<NB, MB>(p, n0, m0);
  } else {
    block_bf16_avx2<NB, MB>(p, n0, m0);
  }
}

template <typename T>
constexpr int kInBlockAvx2 = std::is_same_v<T, float> ? 3 : 2;  // input rows per register block

template <typename T, int NB>
void block_avx2(const Problem<T>& p, int64_t n0, int64_t m0, int mb) {
  if constexpr (kInBlockAvx2<T> == 3) {
    if (mb == 1) return block_of_avx2<T, NB, 1>(p, n0, m0);
    if (mb == 2) return block_of_avx2<T, NB, 2>(p, n0, m0);
    return block_of_avx2<T, NB, 3>(p, n0, m0);
  } else {
    if (mb == 1) return block_of_avx2<T, NB, 1>(p, n0, m0);
    return block_of_avx2<T, NB, 2>(p, n0, m0);
  }
}

// As linear_avx512: blocks of 2 weight rows (a single row at the end) against blocks of up to 3
// (float32) or 2 (bfloat16) input rows.
template <typename T>
void linear_avx2(const Problem<T>& p, int64_t n_begin, int64_t n_end) {
  constexpr int nb = 2, mb = kInBlockAvx2<T>;
  int64_t n = n_begin;
  for (; n + nb <= n_end; n += nb)
    for (int64_t m = 0; m < p.rows; m += mb)
      block_avx2<T, nb>(p, n, m, static_cast<int>(std::min<int64_t>(mb, p.rows - m)));
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < p.rows; m += mb)
      block_avx2<T, 1>(p, n, m, static_cast<int>(std::min<int64_t>(mb, p.rows - m)));
}

#endif

// The implementations of the op: the portable loop, AVX2 + FMA, AVX-512 (F; BW + VL too for
// bfloat16). The two vector paths give the same bits.
enum class Path { kGeneric, kAvx2, kAvx512, kAvx512Dot };

bool has_avx2() {
#ifdef DARTREE_AVX512_LINEAR
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

bool has_avx512_bf16() {
#ifdef DARTREE_AVX512_LINEAR
  static const bool dot = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return dot;
#else
  return false;
#endif
}

// bfloat16 through VDPBF16PS where it pays (dot_path_pays, measured once); DARTREE_FEW_ROWS_BF16=dot
// or =fma decides instead (for A/B timings: the two give the same bits).
bool dot_wanted() {
#ifdef DARTREE_AVX512_LINEAR
  static const bool wanted = [] {
    const char* env = std::getenv("DARTREE_FEW_ROWS_BF16");
    const std::string choice = env == nullptr ? "" : env;
    if (choice == "dot") return true;
    if (choice == "fma") return false;
    TORCH_CHECK(choice.empty() || choice == "auto", "DARTREE_FEW_ROWS_BF16 must be dot, fma or auto, got '", choice,
                "'");
    return dot_path_pays();
  }();
  return wanted;
#else
  return false;
#endif
}

// The fastest path this CPU runs for a dtype, decided once. VDPBF16PS only past one block of
// input rows (kInBlock): up to 6 rows the op streams the weights from memory at the same speed
// either way (a plain step's single row measured 2-9% faster with the FMAs on a Zen 4 EPYC), past
// them it is compute-bound and VDPBF16PS 1.2-1.9x faster. The two give the same bits, so choosing
// by rows keeps batch invariance.
constexpr int64_t kDotMinRows = 7;

Path best_path(at::ScalarType dtype, int64_t rows = kDotMinRows) {
#ifdef DARTREE_AVX512_LINEAR
  static const bool f32 = __builtin_cpu_supports("avx512f");
  static const bool bf16 = f32 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (dtype == at::kBFloat16 && rows >= kDotMinRows && has_avx512_bf16() && dot_wanted()) return Path::kAvx512Dot;
  if (dtype == at::kBFloat16 ? bf16 : f32) return Path::kAvx512;
#endif
  (void)dtype;
  return has_avx2() ? Path::kAvx2 : Path::kGeneric;
}

template <typename T>
void run(const Problem<T>& p, Path path) {
  const int64_t grain = 64;  // weight rows per task
  at::parallel_for(0, p.out, grain, [&](int64_t begin, int64_t end) {
#ifdef DARTREE_AVX512_LINEAR
    if (path == Path::kAvx512) return linear_avx512(p, begin, end);
    if (path == Path::kAvx512Dot) return linear_avx512<T, true>(p, begin, end);
    if (path == Path::kAvx2) return linear_avx2(p, begin, end);
#endif
    linear_generic(p, begin, end);
  });
}

// x [rows, in] as float32 with each full block of 32 inputs reordered to its 16 even-indexed,
// then its 16 odd-indexed elements (the order block_bf16 widens bfloat16 weights in); a tail of
// fewer than 32 stays in order.
at::Tensor interleave_x(const at::Tensor& flat) {
  const int64_t rows = flat.size(0), in = flat.size(1), pairs = in / 32 * 32;
  at::Tensor x32 = at::empty({rows, in}, flat.options().dtype(at::kFloat));
  const c10::BFloat16* src = flat.data_ptr<c10::BFloat16>();
  float* dst = x32.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    const c10::BFloat16* s = src + m * in;
    float* d = dst + m * in;
    int64_t k = 0;
    for (; k < pairs; k += 32)
      for (int64_t e = 0; e < 16; ++e) {
        d[k + e] = static_cast<float>(s[k + 2 * e]);
        d[k + 16 + e] = static_cast<float>(s[k + 2 * e + 1]);
      }
    for (; k < in; ++k) d[k] = static_cast<float>(s[k]);
  }
  return x32;
}

// `path`: the implementation asked for, or nullopt for the fastest this CPU runs.
at::Tensor few_rows_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               std::optional<Path> path) {
  constexpr const char* op = "few_rows_linear";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must be ", x.scalar_type(), " like x, got ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), op, ": weight must be a contiguous [out, in] matrix, got ",
              weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous)");
  const int64_t in = weight.size(1), out = weight.size(0);
  TORCH_CHECK(x.size(-1) == in, op, ": x has ", x.size(-1), " features but weight expects ", in);
  TORCH_CHECK(x.device() == weight.device(), op, ": x and weight must be on one device");
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  TORCH_CHECK_VALUE(rows <= kMaxRows, op, ": x has ", rows, " rows, at most ", kMaxRows,
                    " (use torch.nn.functional.linear)");
  const at::Tensor flat = x.reshape({rows, in}).contiguous();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias must be ", x.scalar_type(), " like x, got ",
                bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, op, ": bias must have shape [", out, "], got ",
                bias->sizes());
    TORCH_CHECK(bias->device() == x.device(), op, ": bias must be on ", x.device());
    bias32 = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  if (rows == 0 || out == 0) return y;
  const Path use = path.value_or(best_path(x.scalar_type(), rows));
  const bool vector = use == Path::kAvx2 || use == Path::kAvx512;  // the FMA paths read x widened
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run(Problem<float>{flat.data_ptr<float>(), nullptr, weight.data_ptr<float>(), b, y.data_ptr<float>(), rows, in, out}, use);
  } else {
    using bf16 = c10::BFloat16;
    // the vector paths read every 32 inputs as 16 even-indexed, then 16 odd-indexed (block_bf16);
    // the portable loop reads x itself
    const at::Tensor x32 = vector ? interleave_x(flat) : at::Tensor();
    run(Problem<bf16>{flat.data_ptr<bf16>(), vector ? x32.data_ptr<float>() : nullptr, weight.data_ptr<bf16>(), b,
                      y.data_ptr<bf16>(), rows, in, out},
        use);
  }
  return y;
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return few_rows_linear_cpu(x, weight, bias, std::nullopt);
}

at::Tensor few_rows_linear_portable(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
  return few_rows_linear_cpu(x, weight, bias, Path::kGeneric);
}

// The AVX2 path on any CPU that has AVX2 and FMA, AVX-512 or not (tests compare the two).
// The AVX-512 FMA path on a CPU that has it, whatever the default (tests and bench/forward_speed.py
// compare it with VDPBF16PS).
at::Tensor few_rows_linear_avx512(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(best_path(x.scalar_type(), 1) == Path::kAvx512, "few_rows_linear_avx512: this CPU (or build) has no ",
              x.scalar_type() == at::kBFloat16 ? "AVX-512F/BW/VL" : "AVX-512F");
  return few_rows_linear_cpu(x, weight, bias, Path::kAvx512);
}

// VDPBF16PS for bfloat16 on any CPU with AVX-512 BF16, paying or not (tests compare it with the
// FMA paths); float32 takes the AVX-512 path.
at::Tensor few_rows_linear_avx512_bf16(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx512_bf16(), "few_rows_linear_avx512_bf16: this CPU (or build) has no AVX-512 BF16");
  return few_rows_linear_cpu(x, weight, bias, x.scalar_type() == at::kBFloat16 ? Path::kAvx512Dot : Path::kAvx512);
}

at::Tensor few_rows_linear_avx2(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx2(), "few_rows_linear_avx2: this CPU (or build) has no AVX2 + FMA");
  return few_rows_linear_cpu(x, weight, bias, Path::kAvx2);
}

}  // namespace

// Which path runs for a dtype: "avx512", "avx2" or "generic" (build_info()["few_rows_linear"]).
std::string few_rows_linear_path_name(const std::string& dtype) {
  switch (best_path(dtype == "bfloat16" ? at::kBFloat16 : at::kFloat)) {
    case Path::kAvx512: return "avx512";
    case Path::kAvx512Dot: return "avx512_bf16";
    case Path::kAvx2: return "avx2";
    default: return "generic";
  }
}

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
  m.impl("few_rows_linear_portable", &few_rows_linear_portable);
  m.impl("few_rows_linear_avx2", &few_rows_linear_avx2);
  m.impl("few_rows_linear_avx512", &few_rows_linear_avx512);
  m.impl("few_rows_linear_avx512_bf16", &few_rows_linear_avx512_bf16);
}

}  // namespace dartree
