// Element types of the kernels' tensors: float32, float64 and raw 16-bit bfloat16 / float16
// storage (no half/bfloat16 headers, so the same code runs under the CPU emulation), with
// conversions to float (exact) and from float (round to nearest even, as torch's .to() does):
// one PTX cvt instruction each on the GPU (archs >= sm_80), bit manipulation on the host.
#pragma once

#include "common.cuh"

namespace dartree {
namespace kernels {

// Raw 16-bit storage types, so no half/bfloat16 headers are needed here.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

DARTREE_HOST_DEVICE float to_float(float v) { return v; }
DARTREE_HOST_DEVICE float to_float(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}
DARTREE_HOST_DEVICE float to_float(Fp16 v) {
#if defined(__CUDA_ARCH__)
  float f;  // one hardware conversion (exact, as the code below)
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else
  const uint32_t sign = (v.bits & 0x8000u) << 16, exponent = (v.bits >> 10) & 0x1fu, mantissa = v.bits & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    uint32_t m = mantissa;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

DARTREE_HOST_DEVICE double to_float(double v) { return v; }  // float64 stays float64

// 16 bytes of elements, read with one vector load (ld.global.v4 on the GPU).
template <typename Elem>
struct alignas(16) Vec16 {
  static constexpr int kCount = static_cast<int>(16 / sizeof(Elem));
  Elem v[kCount];
};
DARTREE_HOST_DEVICE bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
template <typename Elem>
DARTREE_HOST_DEVICE Vec16<Elem> load_vec16(const Elem* p) {  // p must be 16-byte aligned
  return *reinterpret_cast<const Vec16<Elem>*>(p);
}

DARTREE_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// float -> element type, round to nearest even (torch's conversion; NaN stays a quiet NaN).
template <typename Elem>
struct FromFloat;
template <>
struct FromFloat<float> {
  DARTREE_HOST_DEVICE static float convert(float v) { return v; }
};
template <>
struct FromFloat<double> {
  DARTREE_HOST_DEVICE static double convert(double v) { return v; }
};
// Round to nearest even on the host (torch's conversion; NaN stays a quiet NaN).
DARTREE_HOST_DEVICE Bf16 bf16_from_float_bits(float v) {
  uint32_t x = float_bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((x >> 16) | 0x40u)};
  x += 0x7fffu + ((x >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(x >> 16)};
}

template <>
struct FromFloat<Bf16> {
  DARTREE_HOST_DEVICE static Bf16 convert(float v) {
#if defined(__CUDA_ARCH__)
    uint16_t h;  // sm_80+: one round-to-nearest-even conversion (NaN stays NaN)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return Bf16{h};
#else
    return bf16_from_float_bits(v);
#endif
  }
};
// Round to nearest even on the host (overflow to inf, NaN stays a quiet NaN).
DARTREE_HOST_DEVICE Fp16 fp16_from_float_bits(float v) {
  uint32_t x = float_bits(v);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return Fp16{static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u))};
  if (x >= 0x477ff000u) return Fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal (units of 2^-24) or zero
    if (x < 0x33000000u) return Fp16{static_cast<uint16_t>(sign)};  // below 2^-25 rounds to 0
    const uint32_t exponent = x >> 23, mantissa = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t r = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return Fp16{static_cast<uint16_t>(sign | r)};
  }
  const uint32_t rebiased = x - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t r = rebiased >> 13;
  const uint32_t rest = rebiased & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;
  return Fp16{static_cast<uint16_t>(sign | r)};
}

template <>
struct FromFloat<Fp16> {
  DARTREE_HOST_DEVICE static Fp16 convert(float v) {
#if defined(__CUDA_ARCH__)
    uint16_t h;  // one round-to-nearest-even conversion (overflow to inf, NaN stays NaN)
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return Fp16{h};
#else
    return fp16_from_float_bits(v);
#endif
  }
};

}  // namespace kernels
}  // namespace dartree
