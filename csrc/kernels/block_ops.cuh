// Block- and warp-level building blocks shared by the kernels: the candidate order used by every
// selection (higher score first, then lower index; NaN as -inf), block-wide best / reduce / scan.
// Every function that takes shared scratch must be called by all threads of the block.
#pragma once

#include "common.cuh"
#include "score_order.h"

namespace dartree {
namespace kernels {

constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kPosInf = __builtin_huge_valf();
constexpr int kNoCandidate = 0x7fffffff;

// score_order.h, under the names the kernels use
DARTREE_HOST_DEVICE float sanitize_score(float s) { return score_order::sanitize(s); }

DARTREE_HOST_DEVICE bool better(float score_a, int index_a, float score_b, int index_b) {
  return score_order::before(score_a, index_a, score_b, index_b);
}

struct Candidate {
  float score;
  int index;  // kNoCandidate when empty
};

DARTREE_DEVICE Candidate better_of(Candidate a, Candidate b) {
  if (b.index == kNoCandidate) return a;
  if (a.index == kNoCandidate) return b;
  return better(a.score, a.index, b.score, b.index) ? a : b;
}

// Best candidate over the block. Needs (blockDim.x / 32 + 1) slots of shared scratch. Every
// thread of the block must call it; every thread gets the result.
DARTREE_DEVICE Candidate block_best(Candidate mine, Candidate* s_scratch) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = (blockDim.x + warpSize - 1) / warpSize;
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    Candidate other;
    other.score = __shfl_xor_sync(kFullWarpMask, mine.score, offset);
    other.index = __shfl_xor_sync(kFullWarpMask, mine.index, offset);
    mine = better_of(mine, other);
  }
  if (lane == 0) s_scratch[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    Candidate c = lane < warps ? s_scratch[lane] : Candidate{kNegInf, kNoCandidate};
    for (int offset = warpSize / 2; offset > 0; offset /= 2) {
      Candidate other;
      other.score = __shfl_xor_sync(kFullWarpMask, c.score, offset);
      other.index = __shfl_xor_sync(kFullWarpMask, c.index, offset);
      c = better_of(c, other);
    }
    if (lane == 0) s_scratch[warps] = c;
  }
  __syncthreads();
  return s_scratch[warps];
}

// Exclusive prefix sum of one int per thread over the block; also returns the total. Needs
// (blockDim.x / 32 + 1) ints of shared scratch. Every thread of the block must call it.
DARTREE_DEVICE int block_exclusive_scan(int value, int* s_scratch, int* total) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = (blockDim.x + warpSize - 1) / warpSize;
  int inclusive = value;
  for (int offset = 1; offset < warpSize; offset *= 2) {
    const int up = __shfl_up_sync(kFullWarpMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == warpSize - 1) s_scratch[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int w = 0; w < warps; ++w) {
      const int t = s_scratch[w];
      s_scratch[w] = running;
      running += t;
    }
    s_scratch[warps] = running;
  }
  __syncthreads();
  *total = s_scratch[warps];
  const int result = s_scratch[warp] + inclusive - value;
  __syncthreads();  // the scratch may be reused right after
  return result;
}

DARTREE_DEVICE float warp_sum(float v) {
  for (int offset = warpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarpMask, v, offset);
  return v;
}

DARTREE_DEVICE float warp_max(float v) {
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    const float o = __shfl_xor_sync(kFullWarpMask, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

// Reduce one float per thread over the block (max or sum). Needs 33 floats of scratch.
template <bool kMax>
DARTREE_DEVICE float block_reduce(float v, float* s_scratch) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = (blockDim.x + warpSize - 1) / warpSize;
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    const float o = __shfl_xor_sync(kFullWarpMask, v, offset);
    v = kMax ? (o > v ? o : v) : v + o;
  }
  if (lane == 0) s_scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? s_scratch[lane] : (kMax ? kNegInf : 0.0f);
    for (int offset = warpSize / 2; offset > 0; offset /= 2) {
      const float o = __shfl_xor_sync(kFullWarpMask, w, offset);
      w = kMax ? (o > w ? o : w) : w + o;
    }
    if (lane == 0) s_scratch[32] = w;
  }
  __syncthreads();
  const float result = s_scratch[32];
  __syncthreads();  // scratch reusable right after
  return result;
}

}  // namespace kernels
}  // namespace dartree
