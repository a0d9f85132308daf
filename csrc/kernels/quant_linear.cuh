// Device code for quant_linear: y[M, N] = x[M, K] @ dequant(blocks)[N, K]^T (+ bias) with the
// weights in a GGUF's blocks (q4_0 / q4_1 / q8_0, layouts in csrc/cpu/quant_linear.cpp), x and y
// float32 (the op converts), for the few rows of a decoding step or a tree verification.
#pragma once

#include "common.cuh"
#include "elem.cuh"

namespace dartree {
namespace kernels {

constexpr int kQuantWarpsPerBlock = 4;
constexpr int kQuantRowsPerWarp = 8;  // input rows a warp dots with one weight row
enum QuantKind : int { kQuantQ4_0 = 0, kQuantQ4_1 = 1, kQuantQ8_0 = 2 };

DARTREE_HOST_DEVICE int quant_block_bytes(int kind) { return kind == kQuantQ4_0 ? 18 : kind == kQuantQ4_1 ? 20 : 34; }

DARTREE_DEVICE float quant_half(const uint8_t* p) {
  Fp16 h;
  h.bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
  return to_float(h);
}

// The 32 weights of the block at `blk`, exactly as dartree_ext.quant.dequantize gives them.
template <int Kind>
DARTREE_DEVICE void quant_dequant_block(const uint8_t* blk, float (&w)[32]) {
  const float d = quant_half(blk);
  if (Kind == kQuantQ8_0) {
    DARTREE_UNROLL for (int e = 0; e < 32; ++e) w[e] = d * static_cast<float>(static_cast<int8_t>(blk[2 + e]));
  } else {
    const uint8_t* qs = blk + (Kind == kQuantQ4_1 ? 4 : 2);
    const float m = Kind == kQuantQ4_1 ? quant_half(blk + 2) : 0.0f;
    DARTREE_UNROLL for (int e = 0; e < 16; ++e) {
      const int lo = qs[e] & 0x0F, hi = qs[e] >> 4;
      if (Kind == kQuantQ4_1) {
        w[e] = fmaf(static_cast<float>(lo), d, m);
        w[e + 16] = fmaf(static_cast<float>(hi), d, m);
      } else {
        w[e] = d * static_cast<float>(lo - 8);
        w[e + 16] = d * static_cast<float>(hi - 8);
      }
    }
  }
}

// One warp per (weight row n, group of up to 8 input rows): lane l de-quantizes blocks l, l + 32,
// ... of the row (adjacent lanes read adjacent blocks) into registers and dots each with the
// group's rows; the 32 partial sums of a row are then added by shuffles (the same order for every
// row and group size, so a row's result does not depend on the others).
template <int Kind>
__global__ void quant_linear_kernel(const float* x, const uint8_t* blocks, const float* bias, int rows, int in,
                                    int out, int64_t row_bytes, float* y) {
  const int lane = threadIdx.x % warpSize;
  const int groups = (rows + kQuantRowsPerWarp - 1) / kQuantRowsPerWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kQuantWarpsPerBlock + threadIdx.x / warpSize;
  if (warp >= static_cast<int64_t>(out) * groups) return;  // uniform per warp
  const int n = static_cast<int>(warp / groups);
  const int m0 = static_cast<int>(warp % groups) * kQuantRowsPerWarp;
  const int count = rows - m0 < kQuantRowsPerWarp ? rows - m0 : kQuantRowsPerWarp;
  const int bytes = quant_block_bytes(Kind), nblocks = in / 32;
  const uint8_t* wrow = blocks + n * row_bytes;
  float acc[kQuantRowsPerWarp];
  DARTREE_UNROLL for (int j = 0; j < kQuantRowsPerWarp; ++j) acc[j] = 0.0f;
  for (int b = lane; b < nblocks; b += warpSize) {
    float w[32];
    quant_dequant_block<Kind>(wrow + static_cast<int64_t>(b) * bytes, w);
    for (int j = 0; j < count; ++j) {
      const float* xr = x + static_cast<int64_t>(m0 + j) * in + b * 32;
      float s = 0.0f;
      DARTREE_UNROLL for (int e = 0; e < 32; ++e) s = fmaf(w[e], xr[e], s);
      acc[j] += s;
    }
  }
  DARTREE_UNROLL for (int j = 0; j < kQuantRowsPerWarp; ++j) {
    float v = acc[j];
    for (int offset = warpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarpMask, v, offset);
    if (lane == 0 && j < count) y[static_cast<int64_t>(m0 + j) * out + n] = bias != nullptr ? v + bias[n] : v;
  }
}

void launch_quant_linear(const float* x, const uint8_t* blocks, const float* bias, int kind, int rows, int in,
                         int out, int64_t row_bytes, float* y, cudaStream_t stream) {
  if (rows == 0 || out == 0) return;
  const int64_t warps = static_cast<int64_t>(out) * ((rows + kQuantRowsPerWarp - 1) / kQuantRowsPerWarp);
  const dim3 grid(static_cast<unsigned>((warps + kQuantWarpsPerBlock - 1) / kQuantWarpsPerBlock));
  const dim3 block(32 * kQuantWarpsPerBlock);
  if (kind == kQuantQ4_0) {
    DARTREE_LAUNCH(quant_linear_kernel<kQuantQ4_0>, grid, block, 0, stream, x, blocks, bias, rows, in, out, row_bytes, y);
  } else if (kind == kQuantQ4_1) {
    DARTREE_LAUNCH(quant_linear_kernel<kQuantQ4_1>, grid, block, 0, stream, x, blocks, bias, rows, in, out, row_bytes, y);
  } else {
    DARTREE_LAUNCH(quant_linear_kernel<kQuantQ8_0>, grid, block, 0, stream, x, blocks, bias, rows, in, out, row_bytes, y);
  }
}

}  // namespace kernels
}  // namespace dartree
