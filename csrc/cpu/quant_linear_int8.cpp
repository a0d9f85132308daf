// quant_linear_int8: quant_linear's product with x rounded to 8 bits, as llama.cpp computes it, over
// the blocks repacked so that 16 blocks meet 16 lanes (dartree_ext.quant.pack_int8): the codes go
// through integer dot products (AVX-512 VNNI, 64 products an instruction) and each block's scale is
// applied once, lane by lane, instead of de-quantizing every weight to float32 (which makes
// quant_linear compute-bound at one row).
//
// Packed layout (the same bytes a row as the GGUF's, rearranged): a row's blocks in groups of 16
// (the last group holds the rest, L < 16), each group [L fp16 d][L fp16 m: q4_1 only][codes], the
// codes as 4-byte words word-major: word g of block l at byte 4 * (g * L + l), where a block's
// words are its GGUF quant bytes in order (q4: 4 words of 16 nibble bytes, byte j holding weight
// j in its low nibble and weight j + 16 in its high one; q8: 8 words of 32 int8).
//
// Arithmetic. Per row of x and block b of 32 inputs: dx = max|x| / 127, qx = round-to-nearest-even
// (x * (1 / dx)) clamped to [-127, 127] (0 where dx = 0), t = dx * sum(qx). A block's weights are
// w = d * u + c0 with integer codes u (q4_0: the nibble, c0 = -8 d; q4_1: the nibble, c0 = m; q8_0:
// q + 128, c0 = -128 d), so x . w ~ d * dx * (u . qx) + c0 * t. Block l of a group runs in lane l
// of 16 float32 accumulators: with dot = u . qx (exact in int32 and float32),
//   q4_0, q8_0: acc[l] = fma(fma(float(dot), dx, tc), d, acc[l])   with tc = (c0 / d) * t
//   q4_1:       acc[l] = fma(m, t, fma(float(dot) * dx, d, acc[l]))
// (lanes past a short group take the same operations on zeros), and the result is reduce16(acc)
// (+ bias), halves summed pairwise (8, 4, 2, 1). The portable loop computes the same lanes one at a
// time: the same bits. Every output element is computed alone, so the op is batch-invariant; its
// numbers differ from quant_linear's by the rounding of x (relative 2^-8 a block), the same for a
// plain step and a tree verification.
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
#include "reduce16.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#define DARTREE_VNNI_QUANT 1
// GCC 12's AVX-512 headers start casts and inserts from a deliberately undefined vector, which its
// own uninitialized-use check then reports where they are inlined (GCC bug 105593)
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace dartree {
namespace {

enum Kind : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kGroup = 16;              // blocks a group, one a lane
constexpr int64_t kPrefetchBytes = 4096;    // as quant_linear.cpp


inline int words_of(int kind) { return kind == kQ8_0 ? 8 : 4; }

// x rounded to 8 bits, each group's words laid out as the weights' (word g of block l at 4 (g L + l)),
// 16 lanes a group for the scales (zeros past a short group).
struct QuantizedX {
  int64_t rows, blocks, groups;
  std::vector<int8_t> q;   // [rows, groups, 8 words, 16 lanes, 4 bytes]; q4: words g and g + 4 at 2g, 2g + 1
  std::vector<float> dx;   // [rows, groups, 16]
  std::vector<float> tc;   // [rows, groups, 16]: t (q4_1) or (c0 / d) * t
};

QuantizedX quantize_x(const float* x, int64_t rows, int64_t in, int kind) {
  QuantizedX qx;
  qx.rows = rows;
  qx.blocks = in / kQuantBlock;
  qx.groups = (qx.blocks + kGroup - 1) / kGroup;
  qx.q.assign(rows * qx.groups * 8 * 64, 0);
  qx.dx.assign(rows * qx.groups * 16, 0.0f);
  qx.tc.assign(rows * qx.groups * 16, 0.0f);
  const float c0_over_d = kind == kQ4_0 ? -8.0f : kind == kQ8_0 ? -128.0f : 1.0f;
  int8_t codes[32];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < qx.blocks; ++b) {
      const float* xb = x + m * in + b * kQuantBlock;
      float amax = 0.0f;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xb[e]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int e = 0; e < 32; ++e) {
        const float r = std::nearbyint(xb[e] * id);
        codes[e] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
        sum += codes[e];
      }
      const int64_t group = b / kGroup, lane = b % kGroup, at = m * qx.groups + group;
      qx.dx[at * 16 + lane] = d;
      qx.tc[at * 16 + lane] = c0_over_d * (d * static_cast<float>(sum));
      // vector v (0..7) of the group: the 4 inputs each lane's code word v meets
      for (int v = 0; v < 8; ++v) {
        // q4: vector 2g holds elements 4g.. (low nibbles of word g), 2g + 1 elements 16 + 4g.. (high)
        const int first = kind == kQ8_0 ? 4 * v : (v % 2 == 0 ? 4 * (v / 2) : 16 + 4 * (v / 2));
        std::memcpy(qx.q.data() + (at * 8 + v) * 64 + lane * 4, codes + first, 4);
      }
    }
  }
  return qx;
}

struct Problem {
  const QuantizedX* x;
  const uint8_t* w;
  const float* bias;
  int64_t out, blocks, groups, row_bytes, bytes;
  int kind;
};

// Group k of a weight row: its block count, and where its d, m and codes start.
struct GroupAt {
  int64_t count;
  const uint8_t *d, *m, *codes;
};

inline GroupAt group_at(const Problem& p, const uint8_t* row, int64_t k) {
  const int64_t count = std::min<int64_t>(kGroup, p.blocks - k * kGroup);
  const uint8_t* start = row + k * kGroup * p.bytes;
  const uint8_t* m = start + 2 * count;
  return {count, start, m, p.kind == kQ4_1 ? m + 2 * count : m};
}


// The integer dot of block l of a group with its rounded inputs.
inline int32_t block_dot(const Problem& p, const GroupAt& g, int64_t l, const int8_t* xq) {
  int32_t dot = 0;
  for (int word = 0; word < words_of(p.kind); ++word)
    for (int k = 0; k < 4; ++k) {
      const uint8_t byte = g.codes[4 * (word * g.count + l) + k];
      if (p.kind == kQ8_0) {
        dot += static_cast<uint8_t>(byte ^ 0x80) * xq[(word * 16 + l) * 4 + k];
      } else {
        dot += (byte & 0x0F) * xq[(2 * word * 16 + l) * 4 + k] + (byte >> 4) * xq[((2 * word + 1) * 16 + l) * 4 + k];
      }
    }
  return dot;
}

template <typename T>
void int8_generic(const Problem& p, T* y, int64_t n_begin, int64_t n_end) {
  const QuantizedX& x = *p.x;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t m = 0; m < x.rows; ++m) {
      float acc[16] = {};
      for (int64_t k = 0; k < p.groups; ++k) {
        const GroupAt g = group_at(p, row, k);
        const int64_t at = m * x.groups + k;
        const int8_t* xq = x.q.data() + at * 8 * 64;
        for (int64_t l = 0; l < 16; ++l) {
          const bool live = l < g.count;
          const float dot = live ? static_cast<float>(block_dot(p, g, l, xq)) : 0.0f;
          const float d = live ? quant_half(g.d + 2 * l) : 0.0f, dx = x.dx[at * 16 + l], tc = x.tc[at * 16 + l];
          if (p.kind == kQ4_1) {
            const float mm = live ? quant_half(g.m + 2 * l) : 0.0f;
            acc[l] = std::fma(mm, tc, std::fma(dot * dx, d, acc[l]));
          } else {
            acc[l] = std::fma(std::fma(dot, dx, tc), d, acc[l]);
          }
        }
      }
      float sum = reduce16_lanes(acc);
      if (p.bias != nullptr) sum += p.bias[n];
      y[m * p.out + n] = static_cast<T>(sum);
    }
  }
}

#ifdef DARTREE_VNNI_QUANT

#define DARTREE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// 4 or 8 lanes of 32-bit elements in a 128- or 256-bit vector, and the first lanes of a 512-bit one.
template <int W>
struct Narrow;

template <>
struct Narrow<4> {
  using I = __m128i;
  using F = __m128;
  static DARTREE_VNNI_TARGET I words(__mmask16 m, const void* p) { return _mm_maskz_loadu_epi32(m, p); }
  static DARTREE_VNNI_TARGET I load(const void* p) { return _mm_loadu_si128(static_cast<const I*>(p)); }
  static DARTREE_VNNI_TARGET F halves(__mmask16 m, const void* p) {
    return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, p));
  }
  static DARTREE_VNNI_TARGET F floats(const float* p) { return _mm_loadu_ps(p); }
  static DARTREE_VNNI_TARGET I dot(I acc, I u, I x) { return _mm_dpbusd_epi32(acc, u, x); }
  static DARTREE_VNNI_TARGET I add(I a, I b) { return _mm_add_epi32(a, b); }
  static DARTREE_VNNI_TARGET I nibbles(I w, int shift) {
    return _mm_and_si128(shift ? _mm_srli_epi16(w, 4) : w, _mm_set1_epi8(0x0F));
  }
  static DARTREE_VNNI_TARGET I flip(I w) { return _mm_xor_si128(w, _mm_set1_epi8(static_cast<char>(0x80))); }
  static DARTREE_VNNI_TARGET F low(__m512 a) { return _mm512_castps512_ps128(a); }
  static DARTREE_VNNI_TARGET __m512 with_low(__m512 a, F lo) { return _mm512_insertf32x4(a, lo, 0); }
  static DARTREE_VNNI_TARGET F cvt(I a) { return _mm_cvtepi32_ps(a); }
  static DARTREE_VNNI_TARGET F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static DARTREE_VNNI_TARGET F fma(F a, F b, F c) { return _mm_fmadd_ps(a, b, c); }
};

template <>
struct Narrow<8> {
  using I = __m256i;
  using F = __m256;
  static DARTREE_VNNI_TARGET I words(__mmask16 m, const void* p) { return _mm256_maskz_loadu_epi32(m, p); }
  static DARTREE_VNNI_TARGET I load(const void* p) { return _mm256_loadu_si256(static_cast<const I*>(p)); }
  static DARTREE_VNNI_TARGET F halves(__mmask16 m, const void* p) {
    return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m, p));
  }
  static DARTREE_VNNI_TARGET F floats(const float* p) { return _mm256_loadu_ps(p); }
  static DARTREE_VNNI_TARGET I dot(I acc, I u, I x) { return _mm256_dpbusd_epi32(acc, u, x); }
  static DARTREE_VNNI_TARGET I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static DARTREE_VNNI_TARGET I nibbles(I w, int shift) {
    return _mm256_and_si256(shift ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(0x0F));
  }
  static DARTREE_VNNI_TARGET I flip(I w) { return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static DARTREE_VNNI_TARGET F low(__m512 a) { return _mm512_castps512_ps256(a); }
  static DARTREE_VNNI_TARGET __m512 with_low(__m512 a, F lo) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(a), _mm256_castps_pd(lo), 0));
  }
  static DARTREE_VNNI_TARGET F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static DARTREE_VNNI_TARGET F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static DARTREE_VNNI_TARGET F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

// The last group k of a row when it holds at most W blocks: the 512-bit path's operations on its
// lanes 0..W-1 (the lanes past them would take operations on zeros, which leave an accumulator as
// it is: it is never -0), on W-lane vectors.
template <int K, int NB, int MB, int W>
DARTREE_VNNI_TARGET void short_group(const Problem& p, const uint8_t* const* rows, int64_t m0, int64_t k,
                                     __m512 (&acc)[NB][MB]) {
  using V = Narrow<W>;
  const QuantizedX& x = *p.x;
  const int64_t count = p.blocks - k * kGroup;
  const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
  typename V::F d[NB], mm[NB];
  typename V::I codes[NB][8];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
    const GroupAt g = group_at(p, rows[i], k);
    d[i] = V::halves(lanes, g.d);
    if constexpr (K == kQ4_1) mm[i] = V::halves(lanes, g.m);
    const int words = K == kQ8_0 ? 8 : 4;
    _Pragma("GCC unroll 8") for (int w = 0; w < words; ++w) {
      const typename V::I word = V::words(lanes, g.codes + 4 * w * count);
      if constexpr (K == kQ8_0) {
        codes[i][w] = V::flip(word);
      } else {
        codes[i][2 * w] = V::nibbles(word, 0);
        codes[i][2 * w + 1] = V::nibbles(word, 1);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
    const int64_t at = (m0 + j) * x.groups + k;
    const int8_t* xq = x.q.data() + at * 8 * 64;
    const typename V::F dx = V::floats(x.dx.data() + at * 16), tc = V::floats(x.tc.data() + at * 16);
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
      typename V::I dot{}, odd{};
      _Pragma("GCC unroll 8") for (int v = 0; v < 8; v += 2) {
        dot = V::dot(dot, codes[i][v], V::load(xq + v * 64));
        odd = V::dot(odd, codes[i][v + 1], V::load(xq + (v + 1) * 64));
      }
      const typename V::F total = V::cvt(V::add(dot, odd)), lo = V::low(acc[i][j]);
      typename V::F next;
      if constexpr (K == kQ4_1) {
        next = V::fma(mm[i], tc, V::fma(V::mul(total, dx), d[i], lo));
      } else {
        next = V::fma(V::fma(total, dx, tc), d[i], lo);
      }
      acc[i][j] = V::with_low(acc[i][j], next);
    }
  }
}

// NB weight rows x MB rows of x.
template <int K, typename T, int NB, int MB>
DARTREE_VNNI_TARGET void block_vnni(const Problem& p, T* y, int64_t n0, int64_t m0) {
  const QuantizedX& x = *p.x;
  __m512 acc[NB][MB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* rows[NB];
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) rows[i] = p.w + (n0 + i) * p.row_bytes;
  const bool fetch = m0 == 0;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  // a short last group of at most 8 blocks runs on 128- or 256-bit vectors (its lanes 0..7)
  const int64_t full = p.blocks / kGroup, tail = p.blocks % kGroup;
  const int64_t groups = tail != 0 && tail <= 8 ? full : p.groups;
  for (int64_t k = 0; k < groups; ++k) {
    const int64_t count = std::min<int64_t>(kGroup, p.blocks - k * kGroup);
    const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
    __m512 d[NB], mm[NB];
    __m512i codes[NB][8];
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
      const GroupAt g = group_at(p, rows[i], k);
      if (fetch) {
        _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 192), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 256), _MM_HINT_T0);
        if constexpr (K == kQ8_0) {
          _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 320), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 384), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 448), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(g.d + kPrefetchBytes + 512), _MM_HINT_T0);
        }
      }
      d[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, g.d));
      if constexpr (K == kQ4_1) mm[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, g.m));
      const int words = K == kQ8_0 ? 8 : 4;
      _Pragma("GCC unroll 8") for (int w = 0; w < words; ++w) {
        const __m512i word = _mm512_maskz_loadu_epi32(lanes, g.codes + 4 * w * count);
        if constexpr (K == kQ8_0) {
          codes[i][w] = _mm512_xor_si512(word, _mm512_set1_epi8(static_cast<char>(0x80)));
        } else {
          codes[i][2 * w] = _mm512_and_si512(word, nib);
          codes[i][2 * w + 1] = _mm512_and_si512(_mm512_srli_epi16(word, 4), nib);
        }
      }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * x.groups + k;
      const int8_t* xq = x.q.data() + at * 8 * 64;
      const __m512 dx = _mm512_loadu_ps(x.dx.data() + at * 16);
      const __m512 tc = _mm512_loadu_ps(x.tc.data() + at * 16);
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) {
        // two chains of integer dot products (exact: the sum is the same in any order)
        __m512i dot = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v += 2) {
          dot = _mm512_dpbusd_epi32(dot, codes[i][v], _mm512_loadu_si512(xq + v * 64));
          odd = _mm512_dpbusd_epi32(odd, codes[i][v + 1], _mm512_loadu_si512(xq + (v + 1) * 64));
        }
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(dot, odd));
        if constexpr (K == kQ4_1) {
          acc[i][j] = _mm512_fmadd_ps(mm[i], tc, _mm512_fmadd_ps(_mm512_mul_ps(f, dx), d[i], acc[i][j]));
        } else {
          acc[i][j] = _mm512_fmadd_ps(_mm512_fmadd_ps(f, dx, tc), d[i], acc[i][j]);
        }
      }
    }
  }
  if (groups < p.groups) {
    if (tail <= 4) {
      short_group<K, NB, MB, 4>(p, rows, m0, groups, acc);
    } else {
      short_group<K, NB, MB, 8>(p, rows, m0, groups, acc);
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < MB; ++j) {
      float sum = reduce16(acc[i][j]);
      if (p.bias != nullptr) sum += p.bias[n0 + i];
      y[(m0 + j) * p.out + n0 + i] = static_cast<T>(sum);
    }
}

constexpr int kRowBlock = 1, kInBlock = 8;  // a row's 8 code vectors and 8 rows' accumulators in registers

template <int K, typename T>
void block_rows(const Problem& p, T* y, int64_t n0, int64_t m0, int mb) {
  switch (mb) {
    case 1: return block_vnni<K, T, kRowBlock, 1>(p, y, n0, m0);
    case 2: return block_vnni<K, T, kRowBlock, 2>(p, y, n0, m0);
    case 3: return block_vnni<K, T, kRowBlock, 3>(p, y, n0, m0);
    case 4: return block_vnni<K, T, kRowBlock, 4>(p, y, n0, m0);
    case 5: return block_vnni<K, T, kRowBlock, 5>(p, y, n0, m0);
    case 6: return block_vnni<K, T, kRowBlock, 6>(p, y, n0, m0);
    case 7: return block_vnni<K, T, kRowBlock, 7>(p, y, n0, m0);
    default: return block_vnni<K, T, kRowBlock, kInBlock>(p, y, n0, m0);
  }
}

// The rows of x in the fewest passes of at most kInBlock rows, of sizes differing by at most one (9
// rows: 5 and 4, not 8 and 1, whose lone row would wait on its chains of dot products).
template <int K, typename T>
void int8_vnni(const Problem& p, T* y, int64_t n_begin, int64_t n_end) {
  const int64_t rows = p.x->rows, passes = (rows + kInBlock - 1) / kInBlock;
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t pass = 0, m = 0; pass < passes; ++pass) {
      const int64_t mb = rows / passes + (pass < rows % passes ? 1 : 0);
      block_rows<K, T>(p, y, n, m, static_cast<int>(mb));
      m += mb;
    }
}

#endif

bool has_vnni() {
#ifdef DARTREE_VNNI_QUANT
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
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
  const QuantShape s = check_quant_inputs("quant_linear_int8", x, blocks, kind_name, bias);
  TORCH_CHECK(x.device().is_cpu(), "quant_linear_int8: a CPU op, got x on ", x.device());
  const QuantStaging staged = stage_quant_inputs(x, s, bias);
  at::Tensor y = at::empty(staged.out_shape, x.options());
  if (staged.empty()) return y;
  const QuantizedX qx = quantize_x(staged.x32.data_ptr<float>(), s.rows, s.in, s.kind);
  const Problem p{&qx, blocks.data_ptr<uint8_t>(), staged.bias_ptr(), s.out,
                  qx.blocks, qx.groups, s.row_bytes, quant_block_bytes_of(s.kind), s.kind};
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
