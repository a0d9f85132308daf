// The 16 float32 lanes of an AVX-512 accumulator summed in a fixed order: halves added pairwise
// (8, 4, 2, 1). Shared by few_rows_linear and quant_linear, whose results are specified in it.
#pragma once

namespace dartree {

// The same order on 16 floats in memory (the portable paths).
inline float reduce16_lanes(const float* l) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

}  // namespace dartree

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>

namespace dartree {

// (GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm*_undefined_* placeholders, GCC
// bug 105593; the pragmas silence that, not a real use of an undefined value.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"), always_inline)) inline float reduce16(__m512 acc) {
  const __m256 lo = _mm512_castps512_ps256(acc);
  const __m256 hi = _mm512_castps512_ps256(_mm512_shuffle_f32x4(acc, acc, 0xEE));  // lanes 8..15
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
#pragma GCC diagnostic pop

}  // namespace dartree

#endif
