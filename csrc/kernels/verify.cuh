// Device code for the tree verification walk (greedy match of the target's token at each node).
#pragma once

#include "common.cuh"

namespace dartree {
namespace kernels {

constexpr int kVerifyWarpsPerBlock = 4;

// One warp per request. From the current node, the warp scans the later nodes 32 at a time for a
// child whose token equals the target's token after the current node; the ballot's lowest set
// lane is the lowest-index match. Children always have larger indices than their parent, so the
// scan starts right after the current node and the walk cannot revisit a node.
__global__ void verify_tree_kernel(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                                   const int64_t* target_tokens, int batch, int n_max, int32_t* accept_nodes,
                                   int32_t* accept_len, int64_t* bonus) {
  const int lane = threadIdx.x % warpSize;
  const int b = blockIdx.x * kVerifyWarpsPerBlock + threadIdx.x / warpSize;
  if (b >= batch) return;  // uniform per warp
  const int n = sanitized_count(num_nodes[b], n_max);
  const int64_t base = static_cast<int64_t>(b) * n_max;
  const int64_t* row_tokens = tokens + base;
  const int32_t* row_parents = parents + base;
  const int64_t* row_target = target_tokens + base;
  int32_t* path = accept_nodes + base;

  int current = 0;
  int length = 0;
  if (lane == 0) path[0] = 0;
  for (;;) {
    const int64_t wanted = row_target[current];
    int next = -1;
    for (int start = current + 1; start < n; start += warpSize) {
      const int j = start + lane;
      const bool hit = j < n && row_parents[j] == current && row_tokens[j] == wanted;
      const unsigned ballot = __ballot_sync(kFullWarpMask, hit);
      if (ballot != 0u) {
        next = start + __ffs(static_cast<int>(ballot)) - 1;
        break;
      }
    }
    if (next < 0) break;
    ++length;
    if (lane == 0) path[length] = next;
    current = next;
  }
  for (int k = length + 1 + lane; k < n_max; k += warpSize) path[k] = -1;
  if (lane == 0) {
    accept_len[b] = length;
    bonus[b] = row_target[current];
  }
}

void launch_verify_tree(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                               const int64_t* target_tokens, int batch, int n_max, int32_t* accept_nodes,
                               int32_t* accept_len, int64_t* bonus, cudaStream_t stream) {
  if (batch == 0 || n_max == 0) return;
  const dim3 grid(static_cast<unsigned>((batch + kVerifyWarpsPerBlock - 1) / kVerifyWarpsPerBlock));
  DARTREE_LAUNCH(verify_tree_kernel, grid, dim3(32 * kVerifyWarpsPerBlock), 0, stream, tokens, parents, num_nodes,
                 target_tokens, batch, n_max, accept_nodes, accept_len, bonus);
}

}  // namespace kernels
}  // namespace dartree
