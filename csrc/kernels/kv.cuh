// Device code for KV-cache compaction: move each request's accepted tree entries to contiguous
// slots right after its prefix, in place, in [B, H, S, Dh] caches (transformers' layout, every
// layer's keys and values in one launch) or in paged pools.
#pragma once

#include "common.cuh"

namespace dartree {
namespace kernels {

constexpr int kKvThreads = 256;
constexpr int kKvSharedBytes = 32 * 1024;

// grid (B x max_heads, caches). Block (b, h, c) moves request b's rows of head h of cache c (a
// block whose h is past that cache's heads returns at once). Sources and destinations may
// overlap, so the block stages a chunk of columns of all its moved rows in shared memory,
// synchronizes, then writes them: correct for any order of the source positions. Columns are
// independent, so chunking over the row keeps shared memory bounded. `Unit` is an unsigned
// integer the width of the copy unit: the copy moves bits, whatever the dtype.
template <typename Unit>
__global__ void compact_kv_layers_kernel(LayerKvCaches caches, int max_heads, int64_t seq,
                                         const int64_t* src_positions, const int64_t* dst_start,
                                         const int32_t* lengths, int l_max, int chunk) {
  DARTREE_DYNAMIC_SHARED(Unit, s_rows);
  const int c = blockIdx.y;
  const int b = static_cast<int>(blockIdx.x / max_heads), h = static_cast<int>(blockIdx.x % max_heads);
  const int heads = caches.heads[c];
  if (h >= heads) return;  // the whole block, before any barrier
  int n = lengths[b];
  n = n < 0 ? 0 : (n > l_max ? l_max : n);
  const int64_t dim = caches.row_units[c];
  const int64_t dst = dst_start[b];
  const int64_t* src = src_positions + static_cast<int64_t>(b) * l_max;
  Unit* base = static_cast<Unit*>(caches.base[c]) + (static_cast<int64_t>(b) * heads + h) * seq * dim;
  for (int64_t col0 = 0; col0 < dim; col0 += chunk) {
    const int cols = static_cast<int>(dim - col0 < chunk ? dim - col0 : chunk);
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int i = idx / cols, col = idx % cols;
      const int64_t pos = src[i];
      if (pos >= 0 && pos < seq) s_rows[i * chunk + col] = base[pos * dim + col0 + col];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int i = idx / cols, col = idx % cols;
      const int64_t pos = src[i], to = dst + i;
      if (pos >= 0 && pos < seq && to >= 0 && to < seq) base[to * dim + col0 + col] = s_rows[i * chunk + col];
    }
    __syncthreads();
  }
}

template <typename Unit>
void launch_compact_kv_layers_as(const LayerKvCaches& caches, int batch, int64_t seq, const int64_t* src_positions,
                                 const int64_t* dst_start, const int32_t* lengths, int l_max, cudaStream_t stream) {
  int64_t widest = 1;
  int max_heads = 1;
  for (int c = 0; c < caches.count; ++c) {
    widest = caches.row_units[c] > widest ? caches.row_units[c] : widest;
    max_heads = caches.heads[c] > max_heads ? caches.heads[c] : max_heads;
  }
  const int per_column = l_max * static_cast<int>(sizeof(Unit));
  int64_t chunk = kKvSharedBytes / per_column;
  chunk = chunk < 1 ? 1 : (chunk > widest ? widest : chunk);
  const size_t shared = static_cast<size_t>(chunk) * per_column;
  auto kernel = compact_kv_layers_kernel<Unit>;
  DARTREE_LAUNCH(kernel, dim3(static_cast<unsigned>(batch * max_heads), static_cast<unsigned>(caches.count)),
                 dim3(kKvThreads), shared, stream, caches, max_heads, seq, src_positions, dst_start, lengths, l_max,
                 static_cast<int>(chunk));
}

void launch_compact_kv_layers(const LayerKvCaches& caches, int unit_bytes, int batch, int64_t seq,
                              const int64_t* src_positions, const int64_t* dst_start, const int32_t* lengths,
                              int l_max, cudaStream_t stream) {
  if (batch == 0 || caches.count == 0 || l_max == 0) return;
  switch (unit_bytes) {
    case 8: launch_compact_kv_layers_as<uint64_t>(caches, batch, seq, src_positions, dst_start, lengths, l_max, stream); break;
    case 4: launch_compact_kv_layers_as<uint32_t>(caches, batch, seq, src_positions, dst_start, lengths, l_max, stream); break;
    case 2: launch_compact_kv_layers_as<uint16_t>(caches, batch, seq, src_positions, dst_start, lengths, l_max, stream); break;
    default: launch_compact_kv_layers_as<uint8_t>(caches, batch, seq, src_positions, dst_start, lengths, l_max, stream);
  }
}

// The pool slot of logical position `pos` through a request's block table, or -1 where the position,
// its table entry or the page it names is outside the table or the pool (memory-safe on any values).
__device__ __forceinline__ int64_t paged_slot(const int32_t* table, int max_pages, int page_size, int64_t num_pages,
                                              int64_t pos) {
  if (pos < 0 || pos / page_size >= max_pages) return -1;
  const int64_t page = table[pos / page_size];
  return page >= 0 && page < num_pages ? page * page_size + pos % page_size : -1;
}

// grid (B, caches). Like compact_kv_layers_kernel, with logical positions mapped to pool slots through
// the request's block table; the block stages a chunk of columns of every moved row before
// writing any, so moves within a page or across pages are correct in any order. A move whose
// source or destination has no slot (paged_slot) is skipped, as the layers kernel skips
// positions outside the cache.
template <typename Unit>
__global__ void compact_kv_paged_kernel(PagedKvCaches caches, int page_size, const int32_t* block_table,
                                        int max_pages, const int64_t* src_positions, const int64_t* dst_start,
                                        const int32_t* lengths, int l_max, int chunk) {
  DARTREE_DYNAMIC_SHARED(Unit, s_rows);
  const int b = blockIdx.x, c = blockIdx.y;
  int n = lengths[b];
  n = n < 0 ? 0 : (n > l_max ? l_max : n);
  const int64_t dim = caches.row_units[c];
  Unit* base = static_cast<Unit*>(caches.base[c]);
  const int32_t* table = block_table + static_cast<int64_t>(b) * max_pages;
  const int64_t* src = src_positions + static_cast<int64_t>(b) * l_max;
  const int64_t dst = dst_start[b];
  for (int64_t col0 = 0; col0 < dim; col0 += chunk) {
    const int cols = static_cast<int>(dim - col0 < chunk ? dim - col0 : chunk);
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int i = idx / cols, col = idx % cols;
      const int64_t slot = paged_slot(table, max_pages, page_size, caches.num_pages, src[i]);
      if (slot >= 0) s_rows[i * chunk + col] = base[slot * dim + col0 + col];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int i = idx / cols, col = idx % cols;
      const int64_t from = paged_slot(table, max_pages, page_size, caches.num_pages, src[i]);
      const int64_t slot = paged_slot(table, max_pages, page_size, caches.num_pages, dst + i);
      if (from >= 0 && slot >= 0) base[slot * dim + col0 + col] = s_rows[i * chunk + col];
    }
    __syncthreads();
  }
}

template <typename Unit>
void launch_compact_kv_paged_as(const PagedKvCaches& caches, int batch, int page_size, const int32_t* block_table,
                                int max_pages, const int64_t* src_positions, const int64_t* dst_start,
                                const int32_t* lengths, int l_max, cudaStream_t stream) {
  int64_t widest = 1;
  for (int c = 0; c < caches.count; ++c) widest = caches.row_units[c] > widest ? caches.row_units[c] : widest;
  const int per_column = l_max * static_cast<int>(sizeof(Unit));
  int64_t chunk = kKvSharedBytes / per_column;
  chunk = chunk < 1 ? 1 : (chunk > widest ? widest : chunk);
  const size_t shared = static_cast<size_t>(chunk) * per_column;
  auto kernel = compact_kv_paged_kernel<Unit>;
  DARTREE_LAUNCH(kernel, dim3(static_cast<unsigned>(batch), static_cast<unsigned>(caches.count)), dim3(kKvThreads),
                 shared, stream, caches, page_size, block_table, max_pages, src_positions, dst_start, lengths, l_max,
                 static_cast<int>(chunk));
}

void launch_compact_kv_paged(const PagedKvCaches& caches, int unit_bytes, int batch, int page_size,
                             const int32_t* block_table, int max_pages, const int64_t* src_positions,
                             const int64_t* dst_start, const int32_t* lengths, int l_max, cudaStream_t stream) {
  if (batch == 0 || caches.count == 0 || l_max == 0) return;
  switch (unit_bytes) {
    case 4: launch_compact_kv_paged_as<uint32_t>(caches, batch, page_size, block_table, max_pages, src_positions, dst_start, lengths, l_max, stream); break;
    case 2: launch_compact_kv_paged_as<uint16_t>(caches, batch, page_size, block_table, max_pages, src_positions, dst_start, lengths, l_max, stream); break;
    default: launch_compact_kv_paged_as<uint8_t>(caches, batch, page_size, block_table, max_pages, src_positions, dst_start, lengths, l_max, stream);
  }
}

}  // namespace kernels
}  // namespace dartree
