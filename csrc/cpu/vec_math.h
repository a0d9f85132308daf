// Float32 math for CPU loops the compiler vectorizes: a polynomial exp (libm's expf / tanhf are
// scalar calls) and widening of 16-bit rows into a float buffer (the c10 16-bit conversions inside
// a loop keep it scalar). Used by the expansion (GRU gates) and the VAT row kernels. The loops
// vectorize only with -fno-trapping-math (set in setup.py and CMakeLists.txt): otherwise GCC keeps
// the clamp's float compares as branches.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

// DARTREE_AVX2_DISPATCH(ret, name, (params), (args)) defines `name` from `name##_impl` (marked
// DARTREE_VEC_INLINE): an AVX2 + FMA build and a baseline x86-64 build of it, and `name` calling
// the first where the CPU has AVX2 and FMA (cpu_has_avx2_fma(), below), else the second; vexp and
// friends are inlined into each. (GCC's target_clones resolver, used before, picked the baseline
// build on an AMD EPYC with AVX-512.) Elsewhere `name` is `name##_impl`.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__CUDACC__)
#define DARTREE_AVX2_DISPATCH(ret, name, params, args)                                    \
  __attribute__((target("avx2,fma"), noinline)) ret name##_avx2 params { return name##_impl args; } \
  __attribute__((noinline)) ret name##_base params { return name##_impl args; }           \
  inline ret name params { return ::dartree::cpu_has_avx2_fma() ? name##_avx2 args : name##_base args; }
#else
#define DARTREE_AVX2_DISPATCH(ret, name, params, args) \
  inline ret name params { return name##_impl args; }
#endif
// Always inlined (GCC otherwise sometimes leaves vexp a call inside a clone, and the loop scalar).
#if defined(__GNUC__)
#define DARTREE_VEC_INLINE inline __attribute__((always_inline))
#else
#define DARTREE_VEC_INLINE inline
#endif

namespace dartree {

// Whether this CPU runs AVX2 + FMA code (explicit dispatch to a target("avx2,fma") build; GCC's
// target_clones resolver picked the baseline build on an AMD EPYC with AVX-512).
inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// Round-to-nearest range reduction x = n ln2 + r with a two-part ln2, Cephes' degree-6 polynomial
// for e^r, 2^n built in the exponent bits. Relative error about 1.2e-7 over the clamped range
// [-87, 88] (tested against torch); below -87 it returns e^-87 (about 1.6e-38), never 0, so callers
// that need exp(-inf) = 0 select it themselves.
DARTREE_VEC_INLINE float vexp(float x) {
  x = x < -87.0f ? -87.0f : x;  // (not std::min / max: GCC may leave those calls in a clone's loop)
  x = x > 88.0f ? 88.0f : x;    // NaN passes through both
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23: rounds to nearest
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * std::bit_cast<float>(bits);
}

DARTREE_VEC_INLINE float vsigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }
DARTREE_VEC_INLINE float vtanh(float x) { return 2.0f / (1.0f + vexp(-2.0f * x)) - 1.0f; }

// bfloat16 bits -> float32 (exact: a shift).
DARTREE_VEC_INLINE float bf16_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// float32 -> bfloat16 bits, round to nearest even (NaN -> 0x7FC0), as c10::BFloat16 converts; a
// branch-free form that vectorizes.
DARTREE_VEC_INLINE uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}
// f rounded to bfloat16 and back (exact): the value a bfloat16 tensor op would store.
DARTREE_VEC_INLINE float bf16_round(float f) { return bf16_float(bf16_bits(f)); }

// n values as float32 into dst: float32 copied, bfloat16 by its bits (a shift: the loop
// vectorizes), other types (float16) through their conversion.
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = bf16_float(bits[j]);
}
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// n values as float32: float rows as they are, others (16-bit) widened into `buffer` first.
inline const float* as_float(const float* row, int64_t, float*) { return row; }
template <typename T>
const float* as_float(const T* row, int64_t n, float* buffer) {
  widen(row, buffer, n);
  return buffer;
}

}  // namespace dartree
