// Host entry points of the device code: plain pointers and a stream, no torch and no CUDA headers.
// Defined in csrc/kernels/<area>.cuh, compiled once per build: by csrc/cuda/<area>.cu under nvcc
// (the CUDA ops in csrc/cuda/<area>_ops.cpp call them) or by csrc/emu/emu_ops.cpp on the CPU.
// Launches are asynchronous on `stream`; pointers are device pointers (host pointers under the
// emulation). Nothing here synchronizes or allocates. The launchers are defined, deliberately
// not `inline`, in the .cuh headers, and exactly one translation unit per binary includes each
// header: an inline definition there would never be emitted for the callers in <area>_ops.cpp,
// which see only these declarations.
#pragma once

#include <cstddef>
#include <cstdint>

#include "elem_type.h"

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
// FlashInfer's packed custom mask: per request b, the bool mask [N, seq_lens[b] + N] (prefix
// visible, then the ancestor bits of `bits [B, N, ceil(N / 64)]`), row-major, packed 8 entries a
// byte little-endian into out[mask_indptr[b] .. mask_indptr[b + 1]) (the last byte zero-padded).
void launch_packed_tree_mask(const uint64_t* bits, const int64_t* seq_lens, const int32_t* mask_indptr, int batch,
                             int n_max, int64_t total_bytes, uint8_t* out, cudaStream_t stream);

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

// kv area: in-place compaction of [B, H_c, S, Dh_c] cache tensors (every layer's keys and values,
// up to kMaxKvLayerCaches per launch, passed by value; the same B and S, heads and row width per
// tensor), rows of row_units[c] units of `unit_bytes` (1, 2, 4 or 8) each; src_positions
// [B, l_max], dst_start [B], lengths [B]. At most kMaxKvMoves entries per request.
constexpr int kMaxKvMoves = 4096;
constexpr int kMaxKvLayerCaches = 64;
struct LayerKvCaches {
  void* base[kMaxKvLayerCaches];
  int64_t row_units[kMaxKvLayerCaches];
  int heads[kMaxKvLayerCaches];
  int count;
};
void launch_compact_kv_layers(const LayerKvCaches& caches, int unit_bytes, int batch, int64_t seq,
                              const int64_t* src_positions, const int64_t* dst_start, const int32_t* lengths,
                              int l_max, cudaStream_t stream);
// Paged pools [num_pages, page_size, ...] (every layer's keys and values, up to kMaxPagedCaches
// per launch, passed by value): request b's logical position p lives in slot
// block_table[b, p / page_size] * page_size + p % page_size of every pool; rows of
// row_units[c] units of `unit_bytes` (1, 2 or 4) each. One launch moves every pool.
constexpr int kMaxPagedCaches = 64;
struct PagedKvCaches {
  void* base[kMaxPagedCaches];
  int64_t row_units[kMaxPagedCaches];
  int count;
  int64_t num_pages;  // pages in every pool: a block-table entry outside [0, num_pages) is skipped
};
void launch_compact_kv_paged(const PagedKvCaches& caches, int unit_bytes, int batch, int page_size,
                             const int32_t* block_table, int max_pages, const int64_t* src_positions,
                             const int64_t* dst_start, const int32_t* lengths, int l_max, cudaStream_t stream);

// expand area: DARTree's depth-wise expansion with a GRU correction head (kernels/expand.cuh).
// The correction head's weights as plain pointers (the data of dartree::HeadWeights), as the
// launchers take them: all of `dtype` (float32, bfloat16 or float16), contiguous.
struct HeadWeightPtrs {
  ElemType dtype;
  const void* w_s;         // [E, G]
  const void* fc2_weight;  // [V, E]
  const void* fc2_bias;    // [V] or null
  const void* gru_table;   // [V, 3G] = embedding x W_ih^T + b_ih
  const void* w_hh;        // [3G, G]
  const void* b_hh;        // [3G] or null
  int e, g;
  int64_t v;               // vocabulary (rows of fc2_weight and gru_table): a candidate id outside [0, V)
                           // is never read; it scores -inf (the kernels stay memory-safe on bad ids)
};

struct ExpandInputs {  // one depth
  const void* z;            // [B, E] rows `z_stride` apart, of the head's dtype
  int64_t z_stride;
  const int64_t* cand_ids;  // [B, K] rows `cand_stride` apart
  const void* cand_base;    // [B, K] rows `cand_stride` apart, of the head's dtype
  int64_t cand_stride;
  const float* parent_states;  // [B, P, G]
  const float* parent_scores;  // [B, P] rows `parent_score_stride` apart
  int64_t parent_score_stride;
  const int32_t* num_parents;  // [B]
  int batch, p_max, k, width;
  float depth_bonus;
};

struct ExpandOutputs {  // rows `stride` apart; the depth's W children start at each row's pointer
  int32_t* parent_idx;  // parent index + parent_offset; -1 for padding
  int32_t* child_k;     // candidate index, or null
  float* scores;
  int64_t* tokens;
  int32_t* depths;      // depth_value for children, -1 for padding; or null
  int64_t stride;
  int parent_offset;
  int depth_value;
  float* child_states;    // [B, W, G]
  int32_t* num_children;  // [B]: min(W, valid parents x K)
};

constexpr int kExpandThreads = 256;  // threads per block of the expand kernels

// Dynamic shared memory of expand_select, in floats: the per-warp top-W lists (warps + 1 lists of
// W scores and indices).
inline int64_t expand_select_shared_floats(int64_t width) { return 2 * (kExpandThreads / 32 + 1) * width; }
constexpr int64_t kExpandSharedLimitFloats = 48 * 1024 / 4;  // what a block gets without opting in

// Floats of the workspace one depth needs: candidate scores [B, P, K], the parents' hidden
// vectors [B, P, E] and the children's parent states [B, W, G].
inline int64_t expand_workspace_floats(int64_t batch, int64_t p_max, int64_t k, int64_t width, int64_t e, int64_t g) {
  return batch * (p_max * k + p_max * e + width * g);
}

// Four launches: expand_hidden, expand_logits, expand_select, expand_update (not when child_states
// is null); none when width is 0.
void launch_expand_depth(const HeadWeightPtrs& head, const ExpandInputs& in, float* workspace, const ExpandOutputs& out,
                         cudaStream_t stream);

struct SupertreeArgs {
  const void* z;            // [B, D, E], head dtype
  const int64_t* cand_ids;  // [B, D, K]
  const void* cand_base;    // [B, D, K], head dtype
  const int64_t* widths;    // host array of D widths; M = their sum, W = their max
  int batch, depth, k;
  float depth_bonus;
  // workspaces, initialized by the caller: states[0] starts with the root states as a contiguous
  // float32 [B, G] (each depth's states are stored densely as [B, width, G]), root_scores = 0,
  // counts[0] = 1
  float* workspace;    // expand_workspace_floats(B, W, K, W, E, G), W = the widest depth
  float* states[2];    // [B, W, G] each
  const float* root_scores;  // [B]
  int32_t* counts[2];  // [B] each
  // outputs [B, M], depth-major
  int64_t* tokens;
  int32_t* parents;  // -1 for the root; padding has depth -1
  int32_t* depths;
  float* scores;
};

// Every depth in turn on `stream`; no host synchronization, so it can be captured in a graph.
void launch_build_supertree(const HeadWeightPtrs& head, const SupertreeArgs& args, cudaStream_t stream);

// linear area: y[rows, out] = x[rows, in] @ dequant(blocks)[out, in]^T (+ bias), float32 x, y and bias;
// blocks: out rows of `row_bytes` bytes, kind 0 = q4_0, 1 = q4_1, 2 = q8_0 (kernels/quant_linear.cuh).
void launch_quant_linear(const float* x, const uint8_t* blocks, const float* bias, int kind, int rows, int in,
                         int out, int64_t row_bytes, float* y, cudaStream_t stream);

}  // namespace kernels
}  // namespace dartree
