// Device-code portability layer shared by every kernel header. Kernels in csrc/kernels/ include no
// torch headers and use only what the CPU emulation (csrc/emu/emu_runtime.h) provides, so the
// same source runs under nvcc and, in the tests, on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "launchers.h"

#if defined(__CUDACC__)

#define DARTREE_DEVICE __device__ __forceinline__
#define DARTREE_HOST_DEVICE __host__ __device__ __forceinline__
#define DARTREE_UNROLL _Pragma("unroll")
#define DARTREE_SHARED_ARRAY(T, name, count) __shared__ T name[count]
#define DARTREE_DYNAMIC_SHARED(T, name)                              \
  extern __shared__ __align__(16) unsigned char dartree_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(dartree_dynamic_smem_)
// `kernel` must be a single token (use a function-pointer alias for templates).
#define DARTREE_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)

#elif defined(DARTREE_EMULATION)

#define DARTREE_DEVICE inline
#define DARTREE_HOST_DEVICE inline
#define DARTREE_UNROLL

#else
#error "csrc/kernels/*.cuh need nvcc or csrc/emu/emu_runtime.h included first"
#endif

namespace dartree {
namespace kernels {

constexpr unsigned kFullWarpMask = 0xffffffffu;

DARTREE_HOST_DEVICE int min_int(int a, int b) { return a < b ? a : b; }

// A node's parent as the kernels see it: -1 for the root, for padding nodes and for an entry that
// breaks the topological layout (0 <= parent < node). CPU ops reject such input; CUDA ops do not
// synchronize to check, so kernels must stay memory-safe and terminate on it.
DARTREE_DEVICE int sanitized_parent(const int32_t* parents, int node, int num_nodes) {
  if (node <= 0 || node >= num_nodes) return -1;
  const int p = parents[node];
  return (p >= 0 && p < node) ? p : -1;
}

// Clamp a request's node count into [1, n_max] for the same reason.
DARTREE_DEVICE int sanitized_count(int32_t count, int n_max) {
  return count < 1 ? 1 : (count > n_max ? n_max : count);
}

}  // namespace kernels
}  // namespace dartree
