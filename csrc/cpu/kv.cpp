// CPU kernel for KV-cache compaction (in place).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../checks/kv.h"

namespace dartree {
namespace {

// Rows move in increasing order; the checked precondition (sources increasing and at or after
// their destination) means a row is never overwritten before it has been read. Caches x requests
// x heads run in parallel.
void compact_caches_cpu(at::TensorList caches, const at::Tensor& src_positions, const at::Tensor& dst_start,
                        const at::Tensor& lengths) {
  const int64_t batch = src_positions.size(0), l_max = src_positions.size(1);
  const int64_t* src = src_positions.data_ptr<int64_t>();
  const int64_t* dst = dst_start.data_ptr<int64_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  std::vector<int64_t> first_row{0};  // cache c's (b, h) rows are [first_row[c], first_row[c + 1])
  for (const auto& cache : caches) first_row.push_back(first_row.back() + batch * cache.size(1));
  at::parallel_for(0, first_row.back(), 1, [&](int64_t begin, int64_t end) {
    size_t c = 0;
    for (int64_t job = begin; job < end; ++job) {
      while (job >= first_row[c + 1]) ++c;
      const at::Tensor& cache = caches[c];
      const int64_t bh = job - first_row[c], b = bh / cache.size(1), seq = cache.size(2);
      const int64_t row_bytes = cache.size(3) * cache.element_size();
      char* rows = static_cast<char*>(cache.data_ptr()) + bh * seq * row_bytes;
      for (int64_t i = 0; i < len[b]; ++i) {
        const int64_t from = src[b * l_max + i], to = dst[b] + i;
        if (from != to) std::memcpy(rows + to * row_bytes, rows + from * row_bytes, row_bytes);
      }
    }
  });
}

void compact_kv_cpu(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& src_positions,
                    const at::Tensor& dst_start, const at::Tensor& lengths) {
  check_compact_kv_moves(keys, values, src_positions, dst_start, lengths);
  check_kv_layer_caches("compact_kv_", {keys, values}, src_positions, {"keys", "values"});
  check_compact_kv_values_cpu("compact_kv_", src_positions, dst_start, lengths, keys.size(2));
  compact_caches_cpu({keys, values}, src_positions, dst_start, lengths);
}

// Every value is checked before any row moves (a bad input leaves the caches as they were).
void compact_kv_layers_cpu(at::TensorList caches, const at::Tensor& src_positions, const at::Tensor& dst_start,
                           const at::Tensor& lengths) {
  check_kv_moves("compact_kv_layers_", src_positions, dst_start, lengths);
  check_kv_layer_caches("compact_kv_layers_", caches, src_positions);
  check_compact_kv_values_cpu("compact_kv_layers_", src_positions, dst_start, lengths, caches[0].size(2));
  compact_caches_cpu(caches, src_positions, dst_start, lengths);
}

// Paged pools: every value is checked before any row moves (a bad input leaves the pools as
// they were). Requests write disjoint slots and read none another writes (checked), so pools x
// requests run in parallel; within a request rows move in increasing order, safe as above.
void compact_kv_paged_cpu(at::TensorList caches, const at::Tensor& block_table, const at::Tensor& src_positions,
                          const at::Tensor& dst_start, const at::Tensor& lengths) {
  check_compact_kv_paged_inputs(caches, block_table, src_positions, dst_start, lengths);
  const int64_t num_pages = caches[0].size(0), page_size = caches[0].size(1);
  check_compact_kv_paged_values_cpu(block_table, src_positions, dst_start, lengths, num_pages, page_size);
  const int64_t batch = block_table.size(0), max_pages = block_table.size(1), l_max = src_positions.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* src = src_positions.data_ptr<int64_t>();
  const int64_t* dst = dst_start.data_ptr<int64_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  const int64_t pools = static_cast<int64_t>(caches.size());
  at::parallel_for(0, pools * batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const at::Tensor& pool = caches[cb / batch];
      const int64_t b = cb % batch;
      const int64_t row_bytes = (num_pages * page_size) != 0 ? pool.numel() / (num_pages * page_size) * pool.element_size() : 0;
      char* base = static_cast<char*>(pool.data_ptr());
      auto slot = [&](int64_t pos) {
        return static_cast<int64_t>(table[b * max_pages + pos / page_size]) * page_size + pos % page_size;
      };
      for (int64_t i = 0; i < len[b]; ++i) {
        const int64_t from = slot(src[b * l_max + i]), to = slot(dst[b] + i);
        if (from != to) std::memcpy(base + to * row_bytes, base + from * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("compact_kv_", &compact_kv_cpu);
  m.impl("compact_kv_layers_", &compact_kv_layers_cpu);
  m.impl("compact_kv_paged_", &compact_kv_paged_cpu);
}

}  // namespace dartree
