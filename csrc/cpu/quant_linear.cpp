// CPU kernel for a linear layer whose weights stay in a GGUF's 4-bit or 8-bit blocks, over the few
// rows of a decoding step or a tree verification: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias).
//
// A weight row is K / 32 blocks of 32 weights in the GGUF's own layout (ggml's block_q4_0, _q4_1,
// _q8_0, little-endian):
//   q4_0: fp16 d, 16 bytes of nibbles          w[i] = d * (q[i] - 8)   (18 bytes)
//   q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w[i] = d * q[i] + m     (20 bytes)
//   q8_0: fp16 d, 32 int8                      w[i] = d * q[i]         (34 bytes)
// where the low nibble of byte j is q[j] and its high nibble q[j + 16]. Each block is read once per
// call and de-quantized in registers (16 float32 lanes: the low nibbles, then the high ones), never
// to memory, then dotted with every row of x (widened to float32 once per call).
//
// Arithmetic, the same on every path: each weight is de-quantized in float32 exactly as written
// above (d * q is exact in float32; q4_1's "+ m" is the one rounding, as a fused multiply-add
// gives it), and each output element is its own 16-lane float32 accumulator over K in index order
// (lane k % 16 takes x[k] * w[k] as one fused multiply-add), the lanes summed pairwise (8, 4, 2, 1),
// then the bias added. That is few_rows_linear's float32 order, so for float32 x the result is
// bit-identical to few_rows_linear(x, dequant(w)) on its AVX-512 path, and row m of the result is
// bit-identical to the result for x[m] alone (batch invariance: a tree verification rounds like a
// plain step). bfloat16 x is widened exactly and the sum rounded to bfloat16 once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "../checks/quant.h"
#include "reduce16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#define DARTREE_AVX512_QUANT 1
#endif

namespace dartree {
namespace {

// How far ahead of the block being read the first pass over a row block fetches (a hint: never
// faults, harmless past the matrix); one distance for every shape, 4 KiB measured no worse than
// 0.7-8 KiB on a 2-vCPU Xeon.
constexpr int64_t kPrefetchBytes = 4096;

constexpr int64_t kBlock = kQuantBlock;

enum class Kind { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };  // check_quant_inputs' numbering

constexpr int64_t block_bytes(Kind kind) { return quant_block_bytes_of(static_cast<int>(kind)); }


template <typename T>
struct Problem {
  const float* x;     // [rows, in] float32
  const uint8_t* w;   // [out, in / 32 * block_bytes]
  const float* bias;  // float32 or nullptr
  T* y;               // [rows, out]
  int64_t rows, in, out, row_bytes;
};


template <typename T>
void store(T* y, float value) {
  y[0] = static_cast<T>(value);  // bfloat16: round to nearest even
}

// One block's 32 weights, de-quantized as the header says (portable path and tests' reference order).
template <Kind K>
void dequant_block(const uint8_t* blk, float* w) {
  const float d = quant_half(blk);
  if constexpr (K == Kind::kQ8_0) {
    for (int e = 0; e < 32; ++e) w[e] = d * static_cast<float>(static_cast<int8_t>(blk[2 + e]));
  } else {
    const uint8_t* qs = blk + (K == Kind::kQ4_1 ? 4 : 2);
    const float m = K == Kind::kQ4_1 ? quant_half(blk + 2) : 0.0f;
    for (int e = 0; e < 16; ++e) {
      const int lo = qs[e] & 0x0F, hi = qs[e] >> 4;
      if constexpr (K == Kind::kQ4_1) {
        w[e] = std::fma(static_cast<float>(lo), d, m);
        w[e + 16] = std::fma(static_cast<float>(hi), d, m);
      } else {
        w[e] = d * static_cast<float>(lo - 8);
        w[e + 16] = d * static_cast<float>(hi - 8);
      }
    }
  }
}


// Portable path: the vector paths' arithmetic, one lane at a time.
template <Kind K, typename T>
void quant_generic(const Problem<T>& p, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = p.in / kBlock;
  float w[32];
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < p.rows; ++m) {
      const float* x = p.x + m * p.in;
      float lanes[16] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        dequant_block<K>(p.w + n * p.row_bytes + b * block_bytes(K), w);
        for (int e = 0; e < 32; ++e) lanes[e % 16] = std::fma(x[b * kBlock + e], w[e], lanes[e % 16]);
      }
      float sum = reduce16_lanes(lanes);
      if (p.bias != nullptr) sum += p.bias[n];
      store(p.y + m * p.out + n, sum);
    }
  }
}

#ifdef DARTREE_AVX512_QUANT

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// One block of one weight row as two float32 vectors (weights 0..15 and 16..31).
template <Kind K>
__attribute__((target("avx512f,avx512bw,f16c"), always_inline)) inline void dequant16x2(const uint8_t* blk,
                                                                                      __m512& w0, __m512& w1) {
  uint16_t dbits;
  std::memcpy(&dbits, blk, 2);
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(dbits));
  if constexpr (K == Kind::kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (K == Kind::kQ4_1 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, nib));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), nib));
    if constexpr (K == Kind::kQ4_1) {
      uint16_t mbits;
      std::memcpy(&mbits, blk + 2, 2);
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(mbits));
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
    } else {
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_sub_epi32(lo, eight);
      hi = _mm512_sub_epi32(hi, eight);
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
    }
  }
}

// NB weight rows x MB input rows, NB * MB accumulators over K.
template <Kind K, typename T, int NB, int MB>
__attribute__((target("avx512f,avx512bw,f16c"))) void block_avx512(const Problem<T>& p, int64_t n0, int64_t m0) {
  constexpr int64_t bytes = block_bytes(K);
  __m512 acc[NB][MB];
  const uint8_t* wp[NB];
  const float* xp[MB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) wp[i] = p.w + (n0 + i) * p.row_bytes;
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) xp[j] = p.x + (m0 + j) * p.in;
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t blocks = p.in / kBlock;
  // the first pass over these rows streams them from memory: fetch the next rows' blocks meanwhile
  const int64_t ahead = m0 == 0 ? kPrefetchBytes : 0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 w0[NB], w1[NB];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
      const uint8_t* blk = wp[i] + b * bytes;
      if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead), _MM_HINT_T0);
      dequant16x2<K>(blk, w0[i], w1[i]);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const __m512 x0 = _mm512_loadu_ps(xp[j] + b * kBlock);
      const __m512 x1 = _mm512_loadu_ps(xp[j] + b * kBlock + 16);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
        acc[i][j] = _mm512_fmadd_ps(x0, w0[i], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(x1, w1[i], acc[i][j]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      store(p.y + (m0 + j) * p.out + n0 + i, sum);
    }
}
#pragma GCC diagnostic pop

// 2 weight rows x up to 12 input rows: 24 accumulators, 4 de-quantized weight vectors, 2 of x. The
// de-quantization (about 8 instructions a row's 32 weights) is shared by 12 rows' 24 FMAs.
constexpr int kRowBlock = 2, kInBlock = 12;

template <Kind K, typename T, int NB>
void block_rows(const Problem<T>& p, int64_t n0, int64_t m0, int mb) {
  switch (mb) {
    case 1: return block_avx512<K, T, NB, 1>(p, n0, m0);
    case 2: return block_avx512<K, T, NB, 2>(p, n0, m0);
    case 3: return block_avx512<K, T, NB, 3>(p, n0, m0);
    case 4: return block_avx512<K, T, NB, 4>(p, n0, m0);
    case 5: return block_avx512<K, T, NB, 5>(p, n0, m0);
    case 6: return block_avx512<K, T, NB, 6>(p, n0, m0);
    case 7: return block_avx512<K, T, NB, 7>(p, n0, m0);
    case 8: return block_avx512<K, T, NB, 8>(p, n0, m0);
    case 9: return block_avx512<K, T, NB, 9>(p, n0, m0);
    case 10: return block_avx512<K, T, NB, 10>(p, n0, m0);
    case 11: return block_avx512<K, T, NB, 11>(p, n0, m0);
    default: return block_avx512<K, T, NB, kInBlock>(p, n0, m0);
  }
}

template <Kind K, typename T>
void quant_avx512(const Problem<T>& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kRowBlock <= n_end; n += kRowBlock)
    for (int64_t m = 0; m < p.rows; m += kInBlock)
      block_rows<K, T, kRowBlock>(p, n, m, static_cast<int>(std::min<int64_t>(kInBlock, p.rows - m)));
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < p.rows; m += kInBlock)
      block_rows<K, T, 1>(p, n, m, static_cast<int>(std::min<int64_t>(kInBlock, p.rows - m)));
}

#endif

bool has_avx512() {
#ifdef DARTREE_AVX512_QUANT
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

template <Kind K, typename T>
void run(const Problem<T>& p, bool vector) {
  at::parallel_for(0, p.out, 64, [&](int64_t begin, int64_t end) {
#ifdef DARTREE_AVX512_QUANT
    if (vector) return quant_avx512<K, T>(p, begin, end);
#endif
    (void)vector;
    quant_generic<K, T>(p, begin, end);
  });
}

template <typename T>
void dispatch(const Problem<T>& p, Kind kind, bool vector) {
  switch (kind) {
    case Kind::kQ4_0: return run<Kind::kQ4_0, T>(p, vector);
    case Kind::kQ4_1: return run<Kind::kQ4_1, T>(p, vector);
    default: return run<Kind::kQ8_0, T>(p, vector);
  }
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind_name,
                            const std::optional<at::Tensor>& bias, bool vector) {
  const QuantShape shape_of = check_quant_inputs("quant_linear", x, blocks, kind_name, bias);
  const Kind kind = static_cast<Kind>(shape_of.kind);
  const int64_t rows = shape_of.rows, in = shape_of.in, out = shape_of.out, row_bytes = shape_of.row_bytes;
  const QuantStaging staged = stage_quant_inputs(x, shape_of, bias);
  at::Tensor y = at::empty(staged.out_shape, x.options());
  if (staged.empty()) return y;
  const at::Tensor& x32 = staged.x32;
  const float* b = staged.bias_ptr();
  vector = vector && has_avx512();
  if (x.scalar_type() == at::kFloat) {
    dispatch(Problem<float>{x32.data_ptr<float>(), blocks.data_ptr<uint8_t>(), b, y.data_ptr<float>(), rows, in, out,
                            row_bytes},
             kind, vector);
  } else {
    dispatch(Problem<c10::BFloat16>{x32.data_ptr<float>(), blocks.data_ptr<uint8_t>(), b,
                                    y.data_ptr<c10::BFloat16>(), rows, in, out, row_bytes},
             kind, vector);
  }
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                        const std::optional<at::Tensor>& bias) {
  return quant_linear_cpu(x, blocks, std::string(kind), bias, true);
}

at::Tensor quant_linear_portable(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                                 const std::optional<at::Tensor>& bias) {
  return quant_linear_cpu(x, blocks, std::string(kind), bias, false);
}

}  // namespace

// Which path quant_linear runs on this CPU: "avx512" or "generic" (build_info()["quant_linear"]).
std::string quant_linear_path_name() { return has_avx512() ? "avx512" : "generic"; }

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_portable", &quant_linear_portable);
}

}  // namespace dartree
