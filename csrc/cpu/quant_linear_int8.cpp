// quant_linear_int8: quant_linear's product with x rounded to 8 bits, as llama.cpp computes it, so
// the blocks' integer codes meet x in integer dot products (AVX-512 VNNI: 64 products an
// instruction) instead of being widened to float32 one by one (which makes quant_linear
// compute-bound at one row).
//
// Per row of x and block b of 32 inputs: dx = max|x| / 127, qx = round-to-nearest-even(x / dx)
// (x * (1 / dx), clamped to [-127, 127]; dx = 0 gives qx = 0), and t_b = dx * sum(qx). A weight
// block is w = d * u + c0 with integer codes u (q4_0: the nibble, c0 = -8 d; q4_1: the nibble,
// c0 = m; q8_0: q + 128, c0 = -128 d), so x . w ~ d * dx * (u . qx) + c0 * t_b. The blocks go in
// pairs (2p, 2p + 1) through 16 float32 lanes, 8 a block: lane l holds the integer dot of 4
// consecutive codes with their qx (exact in int32 and in float32), the lane's block given by the
// kind's byte order (q4: bytes 0-15 block 2p's low nibbles, 16-31 block 2p+1's, 32-47 block 2p's
// high nibbles, 48-63 block 2p+1's; q8: bytes 0-31 block 2p, 32-63 block 2p+1; a missing last
// block is all zeros). With dx, d, m and tc = (c0 / d or 1 for q4_1) * t_b / 8 of the lane's block
// (the c0 term spread over the block's 8 lanes; / 8 is exact):
//   q4_0, q8_0: acc[l] = fma(fma(float(dot[l]), dx, tc), d, acc[l])
//   q4_1:       acc[l] = fma(m, tc, fma(float(dot[l]) * dx, d, acc[l]))
// and the result is reduce16(acc) (+ bias), reduce16 summing halves pairwise (8, 4, 2, 1). The
// portable loop computes the same lanes one at a time: the same bits; every output element is
// computed alone, so the op is batch-invariant like quant_linear. Its numbers differ from
// quant_linear's by the rounding of x (relative 2^-8 a block), the same for a plain step and a
// tree verification.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../checks/quant.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>

#include "reduce16.h"
#define DARTREE_VNNI_QUANT 1
#endif

namespace dartree {
namespace {

// How far ahead of the block being read the first pass over a row block fetches (a hint: never
// faults, harmless past the matrix); one distance for every shape, 4 KiB measured no worse than
// 0.7-8 KiB on a 2-vCPU Xeon.
constexpr int64_t kPrefetchBytes = 4096;

enum Kind : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Where byte k of a pair's 64 lies: block (0 or 1 of the pair) and element in the block.
inline void pair_byte(int kind, int k, int& block, int& element) {
  if (kind == kQ8_0) {
    block = k / 32;
    element = k % 32;
  } else {
    block = (k / 16) % 2;
    element = k % 16 + 16 * (k / 32);
  }
}

// x rounded to 8 bits, in the pairs' byte order.
struct QuantizedX {
  int64_t rows, blocks, pairs;
  std::vector<int8_t> q;     // [rows, pairs, 64]
  std::vector<float> dx;     // [rows, pairs, 16]: the scale of each lane's block (0: no block)
  std::vector<float> tc;     // [rows, pairs, 16]: the lane's share of its block's c0 term (header)
};

QuantizedX quantize_x(const float* x, int64_t rows, int64_t in, int kind) {
  QuantizedX qx;
  qx.rows = rows;
  qx.blocks = in / kQuantBlock;
  qx.pairs = (qx.blocks + 1) / 2;
  qx.q.assign(rows * qx.pairs * 64, 0);
  qx.dx.assign(rows * qx.pairs * 16, 0.0f);
  qx.tc.assign(rows * qx.pairs * 16, 0.0f);
  const float c0_over_d = kind == kQ4_0 ? -8.0f : kind == kQ8_0 ? -128.0f : 1.0f;  // q4_1: c0 = m itself
  std::vector<int8_t> codes(kQuantBlock);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < qx.blocks; ++b) {
      const float* xb = x + m * in + b * kQuantBlock;
      float amax = 0.0f;
      for (int e = 0; e < kQuantBlock; ++e) amax = std::max(amax, std::fabs(xb[e]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int e = 0; e < kQuantBlock; ++e) {
        const float r = std::nearbyint(xb[e] * id);
        codes[e] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
        sum += codes[e];
      }
      const float tc = c0_over_d * (d * static_cast<float>(sum)) / 8.0f;
      const int64_t p = b / 2;
      const int half = static_cast<int>(b % 2);
      int8_t* dst = qx.q.data() + (m * qx.pairs + p) * 64;
      for (int k = 0; k < 64; ++k) {
        int block, element;
        pair_byte(kind, k, block, element);
        if (block == half) dst[k] = codes[element];
      }
      float* lanes = qx.dx.data() + (m * qx.pairs + p) * 16;
      float* shares = qx.tc.data() + (m * qx.pairs + p) * 16;
      for (int l = 0; l < 16; ++l) {
        int block, element;
        pair_byte(kind, 4 * l, block, element);
        if (block == half) {
          lanes[l] = d;
          shares[l] = tc;
        }
      }
    }
  }
  return qx;
}

struct Problem {
  const QuantizedX* x;
  const uint8_t* w;
  const float* bias;
  int64_t out, blocks, pairs, row_bytes, bytes;
  int kind;
};

// Block b's d and m of a weight row (0 past its last block).
inline float scale_at(const Problem& p, const uint8_t* row, int64_t b, int which) {
  return b < p.blocks ? half_at(row + b * p.bytes + 2 * which) : 0.0f;
}

// The integer code of byte k of pair p of a weight row (0 past the row's last block).
inline int code_at(const Problem& p, const uint8_t* row, int64_t pair, int k) {
  int block, element;
  pair_byte(p.kind, k, block, element);
  const int64_t b = 2 * pair + block;
  if (b >= p.blocks) return 0;
  const uint8_t* blk = row + b * p.bytes;
  if (p.kind == kQ8_0) return static_cast<uint8_t>(blk[2 + element] ^ 0x80);
  const uint8_t byte = blk[(p.kind == kQ4_1 ? 4 : 2) + element % 16];
  return element < 16 ? (byte & 0x0F) : (byte >> 4);
}

inline float reduce_lanes(const float* l) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
void int8_generic(const Problem& p, T* y, int64_t n_begin, int64_t n_end) {
  const QuantizedX& x = *p.x;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t m = 0; m < x.rows; ++m) {
      float acc[16] = {};
      for (int64_t pair = 0; pair < p.pairs; ++pair) {
        const int8_t* q = x.q.data() + (m * x.pairs + pair) * 64;
        const float* dx = x.dx.data() + (m * x.pairs + pair) * 16;
        const float* tc = x.tc.data() + (m * x.pairs + pair) * 16;
        for (int l = 0; l < 16; ++l) {
          int32_t dot = 0;
          for (int k = 4 * l; k < 4 * l + 4; ++k) dot += code_at(p, row, pair, k) * q[k];
          int block, element;
          pair_byte(p.kind, 4 * l, block, element);
          const float d = scale_at(p, row, 2 * pair + block, 0);
          if (p.kind == kQ4_1) {
            acc[l] = std::fma(static_cast<float>(dot) * dx[l], d, acc[l]);
            acc[l] = std::fma(scale_at(p, row, 2 * pair + block, 1), tc[l], acc[l]);
          } else {
            acc[l] = std::fma(std::fma(static_cast<float>(dot), dx[l], tc[l]), d, acc[l]);
          }
        }
      }
      float sum = reduce_lanes(acc);
      if (p.bias != nullptr) sum += p.bias[n];
      y[m * p.out + n] = static_cast<T>(sum);
    }
  }
}

#ifdef DARTREE_VNNI_QUANT

// Pair `pair` of a weight row as 64 unsigned codes in the kind's byte order.
template <int K>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline __m512i pair_codes(const Problem& p,
                                                                                             const uint8_t* row,
                                                                                             int64_t pair) {
  const uint8_t* b0 = row + 2 * pair * p.bytes;
  const bool second = 2 * pair + 1 < p.blocks;
  if constexpr (K == kQ8_0) {
    const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    const __m256i y1 = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + p.bytes + 2))
                              : _mm256_set1_epi8(static_cast<char>(0x80));  // codes 0 after the flip
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const int off = K == kQ4_1 ? 4 : 2;
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + off));
    const __m128i r1 = second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + p.bytes + off))
                              : _mm_setzero_si128();
    const __m256i r = _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(r, nib), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), nib);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// The fp16 at `which` (0: d, 1: m) of blocks 2p and 2p + 1 (0 for a missing one) in the 16 lanes
// of their blocks: one conversion and one permutation a pair.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int K>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"), always_inline)) inline __m512 pair_scales(
    const Problem& p, const uint8_t* row, int64_t pair, int which) {
  const uint8_t* b0 = row + 2 * pair * p.bytes + 2 * which;
  uint16_t h0, h1 = 0;
  std::memcpy(&h0, b0, 2);
  if (2 * pair + 1 < p.blocks) std::memcpy(&h1, b0 + p.bytes, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h0 | (static_cast<uint32_t>(h1) << 16))));
  const __m512i lanes = K == kQ8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(f));
}
#pragma GCC diagnostic pop

// NB weight rows x MB rows of x.
template <int K, typename T, int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void block_vnni(const Problem& p, T* y, int64_t n0,
                                                                            int64_t m0) {
  const QuantizedX& x = *p.x;
  __m512 acc[NB][MB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* rows[NB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) rows[i] = p.w + (n0 + i) * p.row_bytes;
  const int64_t ahead = m0 == 0 ? kPrefetchBytes : 0;
  for (int64_t pair = 0; pair < p.pairs; ++pair) {
    __m512i w[NB];
    __m512 dv[NB], mv[NB];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
      if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(rows[i] + ahead + 2 * pair * p.bytes), _MM_HINT_T0);
      w[i] = pair_codes<K>(p, rows[i], pair);
      dv[i] = pair_scales<K>(p, rows[i], pair, 0);
      if constexpr (K == kQ4_1) mv[i] = pair_scales<K>(p, rows[i], pair, 1);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * x.pairs + pair;
      const __m512i q = _mm512_loadu_si512(x.q.data() + at * 64);
      const __m512 dx = _mm512_loadu_ps(x.dx.data() + at * 16);
      const __m512 tc = _mm512_loadu_ps(x.tc.data() + at * 16);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], q));
        if constexpr (K == kQ4_1) {
          acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dx), dv[i], acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(mv[i], tc, acc[i][j]);
        } else {
          acc[i][j] = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, dx, tc), dv[i], acc[i][j]);
        }
      }
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      y[(m0 + j) * p.out + n0 + i] = static_cast<T>(sum);
    }
}

constexpr int kRowBlock = 2, kInBlock = 8;

template <int K, typename T, int NB>
void block_rows(const Problem& p, T* y, int64_t n0, int64_t m0, int mb) {
  switch (mb) {
    case 1: return block_vnni<K, T, NB, 1>(p, y, n0, m0);
    case 2: return block_vnni<K, T, NB, 2>(p, y, n0, m0);
    case 3: return block_vnni<K, T, NB, 3>(p, y, n0, m0);
    case 4: return block_vnni<K, T, NB, 4>(p, y, n0, m0);
    case 5: return block_vnni<K, T, NB, 5>(p, y, n0, m0);
    case 6: return block_vnni<K, T, NB, 6>(p, y, n0, m0);
    case 7: return block_vnni<K, T, NB, 7>(p, y, n0, m0);
    default: return block_vnni<K, T, NB, kInBlock>(p, y, n0, m0);
  }
}

template <int K, typename T>
void int8_vnni(const Problem& p, T* y, int64_t n_begin, int64_t n_end) {
  const int64_t rows = p.x->rows;
  int64_t n = n_begin;
  for (; n + kRowBlock <= n_end; n += kRowBlock)
    for (int64_t m = 0; m < rows; m += kInBlock)
      block_rows<K, T, kRowBlock>(p, y, n, m, static_cast<int>(std::min<int64_t>(kInBlock, rows - m)));
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < rows; m += kInBlock)
      block_rows<K, T, 1>(p, y, n, m, static_cast<int>(std::min<int64_t>(kInBlock, rows - m)));
}

#endif

bool has_vnni() {
#ifdef DARTREE_VNNI_QUANT
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

template <typename T>
void run(const Problem& p, T* y, bool vector) {
  at::parallel_for(0, p.out, 64, [&](int64_t begin, int64_t end) {
#ifdef DARTREE_VNNI_QUANT
    if (vector) {
      if (p.kind == kQ4_0) return int8_vnni<kQ4_0, T>(p, y, begin, end);
      if (p.kind == kQ4_1) return int8_vnni<kQ4_1, T>(p, y, begin, end);
      return int8_vnni<kQ8_0, T>(p, y, begin, end);
    }
#endif
    (void)vector;
    int8_generic<T>(p, y, begin, end);
  });
}

at::Tensor quant_linear_int8_cpu(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind_name,
                                 const std::optional<at::Tensor>& bias, bool vector) {
  const QuantShape s = check_quant_inputs(x, blocks, kind_name, bias);
  TORCH_CHECK(x.device().is_cpu(), "quant_linear_int8: a CPU op, got x on ", x.device());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = s.out;
  at::Tensor y = at::empty(shape, x.options());
  if (s.rows == 0 || s.out == 0) return y;
  const at::Tensor x32 = x.reshape({s.rows, s.in}).to(at::kFloat).contiguous();
  const at::Tensor bias32 = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const QuantizedX qx = quantize_x(x32.data_ptr<float>(), s.rows, s.in, s.kind);
  const Problem p{&qx, blocks.data_ptr<uint8_t>(), bias32.defined() ? bias32.data_ptr<float>() : nullptr, s.out,
                  qx.blocks, qx.pairs, s.row_bytes, quant_block_bytes_of(s.kind), s.kind};
  vector = vector && has_vnni();
  if (x.scalar_type() == at::kFloat) {
    run(p, y.data_ptr<float>(), vector);
  } else {
    run(p, y.data_ptr<c10::BFloat16>(), vector);
  }
  return y;
}

at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                             const std::optional<at::Tensor>& bias) {
  return quant_linear_int8_cpu(x, blocks, std::string(kind), bias, true);
}

at::Tensor quant_linear_int8_portable(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                                      const std::optional<at::Tensor>& bias) {
  return quant_linear_int8_cpu(x, blocks, std::string(kind), bias, false);
}

}  // namespace

// Which path quant_linear_int8 runs on this CPU: "avx512_vnni" or "generic".
std::string quant_linear_int8_path_name() { return has_vnni() ? "avx512_vnni" : "generic"; }

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("quant_linear_int8", &quant_linear_int8);
  m.impl("quant_linear_int8_portable", &quant_linear_int8_portable);
}

}  // namespace dartree
