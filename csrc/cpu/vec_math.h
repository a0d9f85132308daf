// Float32 math for CPU loops the compiler vectorizes: a polynomial exp (libm's expf / tanhf are
// scalar calls) and widening of 16-bit rows into a float buffer (the c10 16-bit conversions inside
// a loop keep it scalar). Used by the expansion (GRU gates) and the VAT row kernels. The loops
// vectorize only with -fno-trapping-math (set in setup.py and CMakeLists.txt): otherwise GCC keeps
// the clamp's float compares as branches.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

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
// that need exp(-inf) = 0 select it themselves. exp_power and exp_reduced are the steps that do
// not depend on the type: vexp (a float) and Lanes<N>::exp (a GCC vector) share them.
template <typename V>
DARTREE_VEC_INLINE V exp_power(V x) {  // n = x / ln2 rounded to the nearest integer, as a float
  return (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23: rounds to nearest
}
template <typename V>
DARTREE_VEC_INLINE V exp_reduced(V x, V n) {  // e^r for r = x - n ln2
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}
DARTREE_VEC_INLINE float vexp(float x) {
  x = x < -87.0f ? -87.0f : x;  // (not std::min / max: GCC may leave those calls in a clone's loop)
  x = x > 88.0f ? 88.0f : x;    // NaN passes through both
  const float n = exp_power(x);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return exp_reduced(x, n) * std::bit_cast<float>(bits);
}

// float32 bits -> bfloat16 bits (the upper 16 of the result), round to nearest even, for a
// uint32_t or a GCC vector of them (a NaN is the caller's to handle).
template <typename U>
DARTREE_VEC_INLINE U bf16_nearest_even(U u) {
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// The same exp on N lanes at once (Lanes<N>), written as GCC vectors: N = 8 is one AVX2 register in
// the AVX2 build (two SSE ones in the baseline build), N = 16 one AVX-512 register in an AVX-512
// build. For loops where an arm of a clamp must not be computed for every lane: in vexp's scalar
// form GCC duplicates the code after the clamp and, in the vector loop, evaluates the clamped copy
// for all lanes; silu's x / (1 + e^88) is then a denormal result for every ordinary x (microcode
// assists: a 5-7x slower loop on AMD Zen 4). A vector select has no arms to copy.
// (Each is inlined, so GCC's note that a wide vector changes the baseline build's call ABI does not
// apply: -Wno-psabi in compile_flags.txt.)
// (The vector types are spelled out per N: GCC drops vector_size with a size that depends on a
// template parameter.)
template <int N>
struct LaneTypes;
template <>
struct LaneTypes<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
};
template <>
struct LaneTypes<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
};
template <int N>
struct Lanes {
  using F = typename LaneTypes<N>::F;
  using I = typename LaneTypes<N>::I;
  using U = typename LaneTypes<N>::U;
  using H = typename LaneTypes<N>::H;

  DARTREE_VEC_INLINE static F splat(float v) { return v - F{}; }  // (v - 0 keeps -0; 0 + v would not)
  DARTREE_VEC_INLINE static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  DARTREE_VEC_INLINE static void store(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }
  // bfloat16 bits -> float32, and float32 -> bfloat16 bits (round to nearest even, NaN -> 0x7FC0):
  // bf16_float / bf16_bits (below) on N lanes.
  DARTREE_VEC_INLINE static F load(const uint16_t* p) {
    H h;
    std::memcpy(&h, p, sizeof(h));
    return (F)(__builtin_convertvector(h, U) << 16);  // (a vector cast reinterprets the bits)
  }
  DARTREE_VEC_INLINE static void store(uint16_t* p, F f) {
    const U bits = f != f ? U{} + 0x7FC0u : bf16_nearest_even((U)f);
    const H h = __builtin_convertvector(bits, H);
    std::memcpy(p, &h, sizeof(h));
  }

  // f rounded to bfloat16 and back (bf16_round on N lanes; a NaN stays a NaN).
  DARTREE_VEC_INLINE static F round_bf16(F f) { return f != f ? f : (F)(bf16_nearest_even((U)f) << 16); }

  DARTREE_VEC_INLINE static F exp(F x) {  // vexp on N lanes
    x = x < -87.0f ? splat(-87.0f) : x;  // NaN passes through both
    x = x > 88.0f ? splat(88.0f) : x;
    const F n = exp_power(x);
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    return exp_reduced(x, n) * (F)bits;
  }
  // silu(g) = g / (1 + e^-g); -0 below -88 (where e^-g leaves float32's range; PyTorch: about
  // -5e-37 down to -88.7, then -0), NaN at -inf (PyTorch: -inf / inf).
  DARTREE_VEC_INLINE static F silu(F g) {
    const F s = g / (1.0f + exp(-g));
    const F low = g == -std::numeric_limits<float>::infinity() ? splat(std::numeric_limits<float>::quiet_NaN())
                                                               : splat(-0.0f);
    return g < -88.0f ? low : s;
  }

  // out = lanes(a, b) over n values, N a call, the last n % N through zero-padded copies.
  template <typename T, typename Fn>
  DARTREE_VEC_INLINE static void binary(const T* a, const T* b, T* out, int64_t n, Fn lanes) {
    int64_t j = 0;
    for (; j + N <= n; j += N) lanes(a + j, b + j, out + j);
    if (j == n) return;
    T at[N] = {}, bt[N] = {}, ot[N];
    std::memcpy(at, a + j, (n - j) * sizeof(T));
    std::memcpy(bt, b + j, (n - j) * sizeof(T));
    lanes(at, bt, ot);
    std::memcpy(out + j, ot, (n - j) * sizeof(T));
  }
};

// Whether this CPU runs the AVX-512 builds (F, BW, VL, DQ; with AVX2 and FMA).
inline bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
  static const bool yes = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq");
  return yes;
#else
  return false;
#endif
}

// DARTREE_LANES_DISPATCH(ret, name, (params), (args)) defines `name` from the template
// `name##_impl<N>` (N lanes, DARTREE_VEC_INLINE): an AVX-512 build with N = 16, an AVX2 + FMA build
// and a baseline build with N = 8, and `name` calling the first the CPU runs.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__CUDACC__)
#define DARTREE_LANES_DISPATCH(ret, name, params, args)                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"), noinline)) ret name##_avx512 params { \
    return name##_impl<16> args;                                                                               \
  }                                                                                                            \
  __attribute__((target("avx2,fma"), noinline)) ret name##_avx2 params { return name##_impl<8> args; }         \
  __attribute__((noinline)) ret name##_base params { return name##_impl<8> args; }                             \
  inline ret name params {                                                                                     \
    return ::dartree::cpu_has_avx512() ? name##_avx512 args                                                    \
           : ::dartree::cpu_has_avx2_fma() ? name##_avx2 args : name##_base args;                              \
  }
#else
#define DARTREE_LANES_DISPATCH(ret, name, params, args) \
  inline ret name params { return name##_impl<8> args; }
#endif

DARTREE_VEC_INLINE float vsigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }
DARTREE_VEC_INLINE float vtanh(float x) { return 2.0f / (1.0f + vexp(-2.0f * x)) - 1.0f; }

// bfloat16 bits -> float32 (exact: a shift).
DARTREE_VEC_INLINE float bf16_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// float32 -> bfloat16 bits, round to nearest even (NaN -> 0x7FC0), as c10::BFloat16 converts; a
// branch-free form that vectorizes.
DARTREE_VEC_INLINE uint16_t bf16_bits(float f) {
  const uint32_t rounded = bf16_nearest_even(std::bit_cast<uint32_t>(f));
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
