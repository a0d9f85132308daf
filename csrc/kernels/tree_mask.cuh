// Device code for the tree-structure ops: ancestor bit masks, the additive tree-attention mask,
// and first-child / next-sibling links. Layout (DESIGN.md): per request b, node 0 is the root,
// parents[b, i] < i for valid nodes, nodes >= num_nodes[b] are padding.
#pragma once

#include "common.cuh"

namespace dartree {
namespace kernels {

constexpr int kAncestorThreads = 256;
constexpr int kMaskRowsPerBlock = 8;
constexpr int kMaskThreads = 256;
constexpr int kLinksThreads = 256;

DARTREE_HOST_DEVICE int words_for(int n) { return (n + 63) / 64; }

// Loads the sanitized parents of nodes [0, end) of one request into shared memory. Every
// ancestor of a node has a smaller index, so rows below `end` need nothing beyond it.
template <typename Index>
DARTREE_DEVICE void load_parents(const int32_t* parents, int n, int end, Index* s_parent) {
  for (int i = threadIdx.x; i < end; i += blockDim.x) s_parent[i] = static_cast<Index>(sanitized_parent(parents, i, n));
}

// Rows per block of tree_ancestor_bits: their words (at most kAncestorSharedWords 64-bit words)
// are built in shared memory and written out as one contiguous, coalesced run.
constexpr int kAncestorSharedWords = 2048;

DARTREE_HOST_DEVICE int ancestor_rows_per_block(int n_max) {
  const int rows = kAncestorSharedWords / words_for(n_max);
  return rows < 1 ? 1 : (rows > kAncestorThreads ? kAncestorThreads : rows);
}

// grid (ceil(N / R), B), R = ancestor_rows_per_block(N). A thread per row walks its root path
// (parents staged in shared memory as int16) and sets the row's bits in shared memory; then the
// block writes its R rows, which are contiguous in the output, with consecutive threads writing
// consecutive words.
__global__ void tree_ancestor_bits_kernel(const int32_t* parents, const int32_t* num_nodes, int n_max,
                                          uint64_t* bits, int32_t* depths) {
  DARTREE_DYNAMIC_SHARED(uint64_t, s_rows);
  const int words = words_for(n_max);
  const int rows_per_block = ancestor_rows_per_block(n_max);
  int16_t* s_parent = reinterpret_cast<int16_t*>(s_rows + static_cast<int64_t>(rows_per_block) * words);
  const int b = blockIdx.y;
  const int n = sanitized_count(num_nodes[b], n_max);
  const int row_begin = blockIdx.x * rows_per_block;
  const int rows = min_int(rows_per_block, n_max - row_begin);
  load_parents(parents + static_cast<int64_t>(b) * n_max, n, min_int(row_begin + rows, n), s_parent);
  for (int w = threadIdx.x; w < rows * words; w += blockDim.x) s_rows[w] = 0;
  __syncthreads();

  if (static_cast<int>(threadIdx.x) < rows) {
    const int i = row_begin + threadIdx.x;
    uint64_t* row = s_rows + static_cast<int64_t>(threadIdx.x) * words;
    int depth = -1;
    if (i < n) {
      for (int node = i; node >= 0; node = s_parent[node]) {
        row[node >> 6] |= 1ull << (node & 63);
        ++depth;
      }
    } else {
      row[i >> 6] = 1ull << (i & 63);  // padding: only itself, depth -1
    }
    depths[static_cast<int64_t>(b) * n_max + i] = depth;
  }
  __syncthreads();
  uint64_t* out = bits + (static_cast<int64_t>(b) * n_max + row_begin) * words;
  for (int w = threadIdx.x; w < rows * words; w += blockDim.x) out[w] = s_rows[w];
}

void launch_tree_ancestor_bits(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max,
                                      uint64_t* bits, int32_t* depths, cudaStream_t stream) {
  if (batch == 0 || n_max == 0) return;
  const int rows = ancestor_rows_per_block(n_max);
  const dim3 grid(static_cast<unsigned>((n_max + rows - 1) / rows), static_cast<unsigned>(batch));
  const size_t shared = sizeof(uint64_t) * static_cast<size_t>(rows) * words_for(n_max) +
                        sizeof(int16_t) * static_cast<size_t>(n_max);
  DARTREE_LAUNCH(tree_ancestor_bits_kernel, grid, dim3(kAncestorThreads), shared, stream, parents, num_nodes, n_max,
                 bits, depths);
}

// grid (ceil(N / kMaskRowsPerBlock), B). The block first builds the ancestor words of its rows in
// shared memory, then all threads stream the rows out coalesced. `Bits` is the unsigned integer
// of the output dtype's width: visible is +0.0 (all bits zero in every float format) and hidden
// is the bit pattern of finfo(dtype).min, computed on the host, so no half types reach here.
template <typename Bits>
__global__ void tree_attention_mask_kernel(const int32_t* parents, const int32_t* num_nodes,
                                           const uint8_t* past_key_mask, int n_max, int past, Bits hidden,
                                           Bits* out) {
  DARTREE_DYNAMIC_SHARED(uint64_t, s_words);
  const int words = words_for(n_max);
  int32_t* s_parent = reinterpret_cast<int32_t*>(s_words + kMaskRowsPerBlock * words);
  const int b = blockIdx.y;
  const int n = sanitized_count(num_nodes[b], n_max);
  const int row_begin = blockIdx.x * kMaskRowsPerBlock;
  const int rows = min_int(kMaskRowsPerBlock, n_max - row_begin);
  load_parents(parents + static_cast<int64_t>(b) * n_max, n, min_int(row_begin + rows, n), s_parent);
  for (int w = threadIdx.x; w < kMaskRowsPerBlock * words; w += blockDim.x) s_words[w] = 0;
  __syncthreads();

  if (static_cast<int>(threadIdx.x) < rows) {
    uint64_t* row_words = s_words + threadIdx.x * words;
    const int i = row_begin + threadIdx.x;
    if (i < n) {
      for (int node = i; node >= 0; node = s_parent[node]) row_words[node >> 6] |= 1ull << (node & 63);
    } else {
      row_words[i >> 6] = 1ull << (i & 63);  // padding sees only itself
    }
  }
  __syncthreads();

  const int64_t columns = static_cast<int64_t>(past) + n_max;
  const uint8_t* past_row = past_key_mask + static_cast<int64_t>(b) * past;
  for (int r = 0; r < rows; ++r) {
    const int i = row_begin + r;
    const bool valid = i < n;
    const uint64_t* row_words = s_words + r * words;
    Bits* out_row = out + (static_cast<int64_t>(b) * n_max + i) * columns;
    for (int64_t c = threadIdx.x; c < columns; c += blockDim.x) {
      bool visible;
      if (c < past) {
        visible = valid && past_row[c] != 0;
      } else {
        const int j = static_cast<int>(c - past);
        visible = (row_words[j >> 6] >> (j & 63)) & 1ull;
      }
      out_row[c] = visible ? Bits(0) : hidden;
    }
  }
}

template <typename Bits>
void launch_tree_attention_mask_as(const int32_t* parents, const int32_t* num_nodes, const uint8_t* past_key_mask,
                                   int batch, int n_max, int past, Bits hidden, Bits* out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((n_max + kMaskRowsPerBlock - 1) / kMaskRowsPerBlock), static_cast<unsigned>(batch));
  const size_t shared = sizeof(uint64_t) * kMaskRowsPerBlock * static_cast<size_t>(words_for(n_max)) +
                        sizeof(int32_t) * static_cast<size_t>(n_max);
  auto kernel = tree_attention_mask_kernel<Bits>;
  DARTREE_LAUNCH(kernel, grid, dim3(kMaskThreads), shared, stream, parents, num_nodes, past_key_mask, n_max, past,
                 hidden, out);
}

void launch_tree_attention_mask(const int32_t* parents, const int32_t* num_nodes, const uint8_t* past_key_mask,
                                int batch, int n_max, int past, int element_bytes, uint64_t hidden, void* out,
                                cudaStream_t stream) {
  if (batch == 0 || n_max == 0) return;
  switch (element_bytes) {
    case 2:
      launch_tree_attention_mask_as<uint16_t>(parents, num_nodes, past_key_mask, batch, n_max, past,
                                              static_cast<uint16_t>(hidden), static_cast<uint16_t*>(out), stream);
      break;
    case 4:
      launch_tree_attention_mask_as<uint32_t>(parents, num_nodes, past_key_mask, batch, n_max, past,
                                              static_cast<uint32_t>(hidden), static_cast<uint32_t*>(out), stream);
      break;
    default:
      launch_tree_attention_mask_as<uint64_t>(parents, num_nodes, past_key_mask, batch, n_max, past, hidden,
                                              static_cast<uint64_t*>(out), stream);
  }
}

// grid (B). The block loads the parents and writes the links out in parallel; one warp links the
// siblings in shared memory, 32 nodes per step (below). int16 indices keep the arrays small.
__global__ void tree_links_kernel(const int32_t* parents, const int32_t* num_nodes, int n_max,
                                  int32_t* next_token, int32_t* next_sibling) {
  DARTREE_DYNAMIC_SHARED(int16_t, s_parent);
  int16_t* s_first_child = s_parent + n_max;
  int16_t* s_next_sibling = s_first_child + n_max;
  const int b = blockIdx.x;
  const int n = sanitized_count(num_nodes[b], n_max);
  load_parents(parents + static_cast<int64_t>(b) * n_max, n, n, s_parent);
  for (int i = threadIdx.x; i < n_max; i += blockDim.x) {
    s_first_child[i] = -1;
    s_next_sibling[i] = -1;
  }
  __syncthreads();
  // Warp 0 walks the nodes 32 at a time, from the last chunk to the first. In a chunk, lanes with
  // the same parent find each other with one match: a node's next sibling is the next such lane,
  // or else the parent's first child in the chunks after this one (s_first_child so far); then
  // each parent's lowest lane in the chunk becomes its first child.
  if (threadIdx.x < warpSize) {
    const int lane = static_cast<int>(threadIdx.x);
    for (int base = n > 0 ? (n - 1) / warpSize * warpSize : -1; base >= 0; base -= warpSize) {
      const int i = base + lane;
      const int p = i >= 1 && i < n ? s_parent[i] : -1;
      const unsigned same = __match_any_sync(kFullWarpMask, p);
      const unsigned after = lane == warpSize - 1 ? 0u : same & (kFullWarpMask << (lane + 1));
      if (p >= 0) s_next_sibling[i] = after ? static_cast<int16_t>(base + __ffs(static_cast<int>(after)) - 1)
                                            : s_first_child[p];
      __syncwarp();
      if (p >= 0 && lane == __ffs(static_cast<int>(same)) - 1) s_first_child[p] = static_cast<int16_t>(i);
      __syncwarp();
    }
  }
  __syncthreads();
  const int64_t base = static_cast<int64_t>(b) * n_max;
  for (int i = threadIdx.x; i < n_max; i += blockDim.x) {
    next_token[base + i] = s_first_child[i];
    next_sibling[base + i] = s_next_sibling[i];
  }
}

void launch_tree_links(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max,
                              int32_t* next_token, int32_t* next_sibling, cudaStream_t stream) {
  if (batch == 0 || n_max == 0) return;
  const size_t shared = 3 * sizeof(int16_t) * static_cast<size_t>(n_max);
  DARTREE_LAUNCH(tree_links_kernel, dim3(static_cast<unsigned>(batch)), dim3(kLinksThreads), shared, stream, parents,
                 num_nodes, n_max, next_token, next_sibling);
}

// grid (X, B): the blocks of request b stride over its bytes; a thread builds one byte from its 8
// mask entries (entry f of the request is row f / L, column f % L, L = seq_len + N), so every
// byte is written exactly once, without atomics, and consecutive threads write consecutive bytes.
__global__ void packed_tree_mask_kernel(const uint64_t* bits, const int64_t* seq_lens, const int32_t* mask_indptr,
                                        int n_max, uint8_t* out) {
  const int b = blockIdx.y;
  const int words = words_for(n_max);
  const int64_t begin = mask_indptr[b], end = mask_indptr[b + 1];
  const int64_t s = seq_lens[b], width = s + n_max, entries = width * n_max;
  const uint64_t* rows = bits + static_cast<int64_t>(b) * n_max * words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < end; k += stride) {
    unsigned byte = 0;
    for (int r = 0; r < 8; ++r) {
      const int64_t f = (k - begin) * 8 + r;
      if (f >= entries) break;
      const int64_t i = f / width, c = f - i * width;
      bool visible = c < s;
      if (!visible) {
        const int64_t j = c - s;
        visible = (rows[i * words + (j >> 6)] >> (j & 63)) & 1ull;
      }
      byte |= static_cast<unsigned>(visible) << r;
    }
    out[k] = static_cast<uint8_t>(byte);
  }
}

void launch_packed_tree_mask(const uint64_t* bits, const int64_t* seq_lens, const int32_t* mask_indptr, int batch,
                             int n_max, int64_t total_bytes, uint8_t* out, cudaStream_t stream) {
  if (batch == 0 || n_max == 0 || total_bytes == 0) return;
  int64_t per_request = (total_bytes / batch + kMaskThreads - 1) / kMaskThreads;
  per_request = per_request < 1 ? 1 : (per_request > 256 ? 256 : per_request);
  const dim3 grid(static_cast<unsigned>(per_request), static_cast<unsigned>(batch));
  DARTREE_LAUNCH(packed_tree_mask_kernel, grid, dim3(kMaskThreads), 0, stream, bits, seq_lens, mask_indptr, n_max,
                 out);
}

}  // namespace kernels
}  // namespace dartree
