// Host entry points of the device code: plain pointers and a stream, no torch and no CUDA headers.
// Defined in csrc/kernels/<area>.cuh, compiled once per build: by csrc/cuda/<area>.cu under nvcc
// (the CUDA ops in csrc/cuda/<area>_ops.cpp call them) or by csrc/emu/emu_ops.cpp on the CPU.
// Launches are asynchronous on `stream`; pointers are device pointers (host pointers under the
// emulation). Nothing here synchronizes or allocates.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // the CUDA runtime's own definition

namespace dartree {
namespace kernels {

// The largest tree (nodes per request, root included) any op accepts. Kernels keep a request's
// parents in shared memory: 8192 x 4 bytes = 32 KiB.
constexpr int kMaxNodes = 8192;
// The largest DDTree budget: each request's heap (budget + 1 entries of 16 bytes) lives in
// shared memory.
constexpr int kMaxHeapBudget = 2048;

// tree_mask area
void launch_tree_ancestor_bits(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max, uint64_t* bits,
                               int32_t* depths, cudaStream_t stream);
// `element_bytes` is the width of the output dtype (2, 4 or 8); `hidden` the bit pattern of its
// finfo.min. Visible entries are +0.0, whose bits are zero in every float format.
void launch_tree_attention_mask(const int32_t* parents, const int32_t* num_nodes, const uint8_t* past_key_mask,
                                int batch, int n_max, int past, int element_bytes, uint64_t hidden, void* out,
                                cudaStream_t stream);
void launch_tree_links(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max, int32_t* next_token,
                       int32_t* next_sibling, cudaStream_t stream);

// verify area
void launch_verify_tree(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                        const int64_t* target_tokens, int batch, int n_max, int32_t* accept_nodes, int32_t* accept_len,
                        int64_t* bonus, cudaStream_t stream);

// select area
void launch_select_top_w(const float* parent_scores, const float* child_logprobs, const int32_t* num_parents,
                         int batch, int p_max, int k, int width, int32_t* parent_idx, int32_t* child_k, float* scores,
                         cudaStream_t stream);
void launch_select_top_b(const int32_t* parents, const float* scores, const int32_t* num_nodes, int batch, int n_max,
                         int budget, int32_t* keep, int32_t* new_parents, int32_t* num_kept, cudaStream_t stream);
void launch_ddtree_heap(const float* logprobs, const int64_t* token_ids, const int64_t* root_tokens, int batch,
                        int depth_max, int k, int budget, int64_t* tokens, int32_t* parents, int32_t* depths,
                        float* scores, int32_t* num_nodes, cudaStream_t stream);

}  // namespace kernels
}  // namespace dartree
