// Input checks of the KV-compaction ops (compact_kv_, compact_kv_layers_, compact_kv_paged_) and their
// copy units.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace dartree {

// The moves of compact_kv_ / compact_kv_layers_: src_positions int64[B, L], dst_start int64[B],
// lengths int32[B], on one device.
inline void check_kv_moves(const char* op, const at::Tensor& src_positions, const at::Tensor& dst_start,
                           const at::Tensor& lengths) {
  check_tensor(op, "src_positions", src_positions, at::kLong, 2);
  check_tensor(op, "dst_start", dst_start, at::kLong, 1);
  check_tensor(op, "lengths", lengths, at::kInt, 1);
  check_same_device(op, "dst_start", dst_start, src_positions, "src_positions");
  check_same_device(op, "lengths", lengths, src_positions, "src_positions");
  const int64_t batch = src_positions.size(0);
  check_shape(op, "dst_start", dst_start, {batch});
  check_shape(op, "lengths", lengths, {batch});
  TORCH_CHECK_VALUE(src_positions.size(1) <= kernels::kMaxKvMoves, op, ": at most ", kernels::kMaxKvMoves,
                    " moved entries per request (src_positions dim 1), got ", src_positions.size(1));
  TORCH_CHECK_VALUE(!src_positions.is_cuda() || batch <= 65535, op, ": CUDA takes at most 65535 requests");
}

// Cache tensors [B, H_c, S, Dh_c] (contiguous, on the moves' device), the same B (the moves') and S.
// Errors name tensor c names[c] when given, else caches[c].
inline void check_kv_layer_caches(const char* op, at::TensorList caches, const at::Tensor& src_positions,
                                  const std::vector<std::string>& names = {}) {
  TORCH_CHECK_VALUE(!caches.empty(), op, ": caches must hold at least one tensor");
  const int64_t batch = src_positions.size(0);
  for (size_t c = 0; c < caches.size(); ++c) {
    const at::Tensor& cache = caches[c];
    const std::string name = c < names.size() ? names[c] : "caches[" + std::to_string(c) + "]";
    TORCH_CHECK(cache.dim() == 4, op, ": ", name, " must be [B, H, S, Dh], got shape ", cache.sizes());
    TORCH_CHECK(cache.is_contiguous(), op, ": ", name, " must be contiguous");
    check_same_device(op, name.c_str(), cache, src_positions, "src_positions");
    TORCH_CHECK_VALUE(cache.size(0) == batch, op, ": ", name, " must have batch size ", batch,
                      " (dim 0, as src_positions), got ", cache.sizes());
    TORCH_CHECK_VALUE(cache.size(2) == caches[0].size(2), op, ": ", name, " ", cache.sizes(), " and the first cache ",
                      caches[0].sizes(), " must have the same sequence length (dim 2)");
    TORCH_CHECK(cache.size(2) < (int64_t{1} << 31) && cache.size(3) < (int64_t{1} << 31) && cache.size(1) <= 65535,
                op, ": ", name, " is too large: ", cache.sizes());
  }
}

inline void check_compact_kv_moves(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& src_positions,
                                   const at::Tensor& dst_start, const at::Tensor& lengths) {
  const char* op = "compact_kv_";
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4, op, ": keys and values must be [B, H, S, Dh], got ", keys.sizes(),
              " and ", values.sizes());
  TORCH_CHECK_VALUE(keys.size(0) == values.size(0) && keys.size(1) == values.size(1) && keys.size(2) == values.size(2),
                    op, ": keys ", keys.sizes(), " and values ", values.sizes(),
                    " must agree on [B, H, S] (only the head dim may differ)");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), op, ": keys (", keys.scalar_type(), ") and values (",
              values.scalar_type(), ") must have one dtype");
  check_kv_moves(op, src_positions, dst_start, lengths);
}

// The widest copy unit (8, 4, 2 or 1 bytes) that divides every cache's row (Dh x element size)
// and every cache's address.
inline int layer_unit_bytes(at::TensorList caches) {
  int unit = 8;
  for (const auto& cache : caches) {
    const int64_t row_bytes = cache.size(3) * cache.element_size();
    const auto address = reinterpret_cast<uintptr_t>(cache.data_ptr());
    while (unit > 1 && (row_bytes % unit != 0 || address % unit != 0)) unit /= 2;
  }
  return unit;
}

// Values, on the CPU: each request moves lengths[b] entries from increasing positions
// src_positions[b, :lengths[b]] >= dst_start[b] to dst_start[b] + i, inside a sequence of `seq`.
inline void check_compact_kv_values_cpu(const char* op, const at::Tensor& src_positions, const at::Tensor& dst_start,
                                        const at::Tensor& lengths, int64_t seq) {
  const int64_t batch = src_positions.size(0), l_max = src_positions.size(1);
  const int64_t* src = src_positions.data_ptr<int64_t>();
  const int64_t* dst = dst_start.data_ptr<int64_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = len[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= l_max, op, ": lengths[", b, "] = ", n, " is outside [0, ", l_max, "]");
    TORCH_CHECK_VALUE(dst[b] >= 0 && dst[b] + n <= seq, op, ": dst_start[", b, "] = ", dst[b], " with ", n,
                      " entries does not fit the cache's ", seq, " positions");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = src[b * l_max + i];
      const int64_t floor = i == 0 ? dst[b] : src[b * l_max + i - 1] + 1;
      TORCH_CHECK_VALUE(pos >= floor && pos < seq, op, ": src_positions[", b, ", ", i, "] = ", pos,
                        " must be in [", floor, ", ", seq, "): increasing, at or after dst_start, inside the cache");
    }
  }
}

// compact_kv_paged_: pools [num_pages, page_size, ...] (contiguous, one device, the same first two
// dims), block_table int32[B, max_pages], the moves as compact_kv_'s (logical positions).
inline void check_compact_kv_paged_inputs(const at::TensorList& caches, const at::Tensor& block_table,
                                          const at::Tensor& src_positions, const at::Tensor& dst_start,
                                          const at::Tensor& lengths) {
  const char* op = "compact_kv_paged_";
  TORCH_CHECK_VALUE(!caches.empty(), op, ": caches must hold at least one pool");
  check_tensor(op, "block_table", block_table, at::kInt, 2);
  check_tensor(op, "src_positions", src_positions, at::kLong, 2);
  check_tensor(op, "dst_start", dst_start, at::kLong, 1);
  check_tensor(op, "lengths", lengths, at::kInt, 1);
  for (const auto* other : {&src_positions, &dst_start, &lengths})
    check_same_device(op, "the moves", *other, block_table, "block_table");
  const int64_t batch = block_table.size(0);
  check_shape(op, "dst_start", dst_start, {batch});
  check_shape(op, "lengths", lengths, {batch});
  TORCH_CHECK_VALUE(src_positions.size(0) == batch, op, ": src_positions must be [B, L] with B = ", batch, ", got ",
                    src_positions.sizes());
  TORCH_CHECK_VALUE(src_positions.size(1) <= kernels::kMaxKvMoves, op, ": at most ", kernels::kMaxKvMoves,
                    " moved entries per request (src_positions dim 1), got ", src_positions.size(1));
  const at::Tensor& first = caches[0];
  for (size_t c = 0; c < caches.size(); ++c) {
    const at::Tensor& pool = caches[c];
    TORCH_CHECK(pool.dim() >= 2, op, ": caches[", c, "] must be [num_pages, page_size, ...], got ", pool.sizes());
    TORCH_CHECK(pool.is_contiguous(), op, ": caches[", c, "] must be contiguous");
    check_same_device(op, "a cache", pool, block_table, "block_table");
    TORCH_CHECK_VALUE(pool.size(0) == first.size(0) && pool.size(1) == first.size(1), op, ": caches[", c, "] ",
                      pool.sizes(), " and caches[0] ", first.sizes(), " must agree on [num_pages, page_size]");
  }
  TORCH_CHECK_VALUE(first.size(1) >= 1, op, ": page_size (caches dim 1) must be >= 1");
  TORCH_CHECK_VALUE(first.size(0) * first.size(1) < (int64_t{1} << 40), op, ": the pool is too large");
  TORCH_CHECK_VALUE(!block_table.is_cuda() || batch <= 2147483647, op, ": too many requests");
}

// Values, on the CPU, before anything moves: each request's moves as compact_kv_'s (increasing
// sources at or after the destination), every touched logical page mapped to a page of the pool,
// a request's touched pages distinct, and no pool slot written twice or written by one request
// while another reads it.
inline void check_compact_kv_paged_values_cpu(const at::Tensor& block_table, const at::Tensor& src_positions,
                                              const at::Tensor& dst_start, const at::Tensor& lengths,
                                              int64_t num_pages, int64_t page_size) {
  const char* op = "compact_kv_paged_";
  const int64_t batch = block_table.size(0), max_pages = block_table.size(1), l_max = src_positions.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* src = src_positions.data_ptr<int64_t>();
  const int64_t* dst = dst_start.data_ptr<int64_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  const int64_t capacity = max_pages * page_size;
  std::vector<std::pair<int64_t, int64_t>> writes, reads;  // (slot, request)
  auto slot_of = [&](int64_t b, int64_t pos, const char* what, int64_t i) {
    const int64_t page = table[b * max_pages + pos / page_size];
    TORCH_CHECK_VALUE(page >= 0 && page < num_pages, op, ": block_table[", b, ", ", pos / page_size, "] = ", page,
                      " (the page of ", what, " ", i, ") is outside the pool's ", num_pages, " pages");
    return page * page_size + pos % page_size;
  };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = len[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= l_max, op, ": lengths[", b, "] = ", n, " is outside [0, ", l_max, "]");
    if (n == 0) continue;
    TORCH_CHECK_VALUE(dst[b] >= 0 && dst[b] + n <= capacity, op, ": dst_start[", b, "] = ", dst[b], " with ", n,
                      " entries does not fit the request's ", capacity, " positions (block_table dim 1 x page_size)");
    std::vector<int32_t> pages;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = src[b * l_max + i];
      const int64_t floor = i == 0 ? dst[b] : src[b * l_max + i - 1] + 1;
      TORCH_CHECK_VALUE(pos >= floor && pos < capacity, op, ": src_positions[", b, ", ", i, "] = ", pos, " must be in [",
                        floor, ", ", capacity, "): increasing, at or after dst_start, inside the request's pages");
      reads.emplace_back(slot_of(b, pos, "source", i), b);
      writes.emplace_back(slot_of(b, dst[b] + i, "destination", i), b);
    }
    const int64_t last_page = src[b * l_max + n - 1] / page_size;
    for (int64_t p = dst[b] / page_size; p <= last_page; ++p) pages.push_back(table[b * max_pages + p]);
    std::sort(pages.begin(), pages.end());
    TORCH_CHECK_VALUE(std::adjacent_find(pages.begin(), pages.end()) == pages.end(), op, ": request ", b,
                      " maps two of its touched logical pages to one pool page (block_table row ", b, ")");
  }
  std::sort(writes.begin(), writes.end());
  for (size_t k = 1; k < writes.size(); ++k)
    TORCH_CHECK_VALUE(writes[k].first != writes[k - 1].first, op, ": requests ", writes[k - 1].second, " and ",
                      writes[k].second, " write the same pool slot ", writes[k].first, " (overlapping destinations)");
  for (const auto& [slot, b] : reads) {
    auto it = std::lower_bound(writes.begin(), writes.end(), std::make_pair(slot, int64_t{-1}));
    for (; it != writes.end() && it->first == slot; ++it)
      TORCH_CHECK_VALUE(it->second == b, op, ": request ", it->second, " writes pool slot ", slot, " that request ", b,
                        " reads (overlapping requests)");
  }
}

// The widest copy unit (4, 2 or 1 bytes) that divides every pool's row.
inline int paged_unit_bytes(const at::TensorList& caches) {
  int unit = 4;
  for (const auto& pool : caches) {
    const int64_t row_bytes = pool.numel() / std::max<int64_t>(1, pool.size(0) * pool.size(1)) * pool.element_size();
    while (unit > 1 && row_bytes % unit != 0) unit /= 2;
  }
  return unit;
}

}  // namespace dartree
