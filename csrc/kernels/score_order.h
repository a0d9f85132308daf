// The order every selection uses, on every backend: higher score first, then lower index; a NaN
// score ranks as -inf. One definition for the CUDA kernels (block_ops.cuh), the CPU kernels
// (cpu/select.cpp, cpu/expand.cpp) and the emulation; dartree_ext/reference.py mirrors it.
// Plain C++ (no torch, no CUDA headers), so host code can include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DARTREE_SCORE_ORDER_FN __host__ __device__ __forceinline__
#else
#define DARTREE_SCORE_ORDER_FN inline
#endif

namespace dartree {
namespace score_order {

constexpr float kNegInf = -__builtin_huge_valf();

// NaN -> -inf; every other score as it is.
DARTREE_SCORE_ORDER_FN float sanitize(float s) { return s != s ? kNegInf : s; }

// Whether (score_a, index_a) comes before (score_b, index_b).
DARTREE_SCORE_ORDER_FN bool before(float score_a, int64_t index_a, float score_b, int64_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

}  // namespace score_order
}  // namespace dartree
