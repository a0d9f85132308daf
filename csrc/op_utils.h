// Host-side helpers shared by the CPU and CUDA implementations: input validation with messages
// that name the op, the argument and what was expected.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/launchers.h"

namespace dartree {

constexpr int64_t kMaxTreeNodes = kernels::kMaxNodes;

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference,
                              const char* reference_name) {
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " is on ", t.device(), " but ", reference_name,
              " is on ", reference.device(), "; all inputs must be on one device");
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ", t.sizes());
}

// dtype, shape and device of a tree (parents int32[B, N], num_nodes int32[B]); cheap, no sync.
inline void check_tree_layout(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tensor(op, "parents", parents, at::kInt, 2);
  check_tensor(op, "num_nodes", num_nodes, at::kInt, 1);
  check_same_device(op, "num_nodes", num_nodes, parents, "parents");
  const int64_t n = parents.size(1);
  TORCH_CHECK_VALUE(n >= 1 && n <= kMaxTreeNodes, op, ": parents must have 1..", kMaxTreeNodes,
                    " nodes per request (dim 1), got ", n);
  check_shape(op, "num_nodes", num_nodes, {parents.size(0)});
  TORCH_CHECK_VALUE(!parents.is_cuda() || parents.size(0) <= 65535, op,
                    ": CUDA kernels take at most 65535 requests per call, got ", parents.size(0));
}

// The values of a tree on the CPU: 1 <= num_nodes[b] <= N and 0 <= parents[b, i] < i for every
// valid non-root node. The root's entry and padding entries are not read.
inline void check_tree_values_cpu(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts[b];
    TORCH_CHECK_VALUE(n >= 1 && n <= n_max, op, ": num_nodes[", b, "] = ", n, " is outside [1, ", n_max, "]");
    for (int64_t i = 1; i < n; ++i) {
      const int64_t p = par[b * n_max + i];
      TORCH_CHECK_VALUE(p >= 0 && p < i, op, ": parents[", b, ", ", i, "] = ", p,
                        " breaks the tree layout; expected 0 <= parent < ", i,
                        " (nodes in topological order, parent before child)");
    }
  }
}

inline void check_tree(const char* op, const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree_layout(op, parents, num_nodes);
  if (parents.device().is_cpu()) check_tree_values_cpu(op, parents, num_nodes);
}

// Bit pattern of finfo(dtype).min, the additive mask's "hidden" value, widened to 64 bits.
inline uint64_t lowest_value_bits(at::ScalarType dtype) {
  uint64_t bits = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "lowest_value_bits", [&] {
    const scalar_t lowest = std::numeric_limits<scalar_t>::lowest();
    std::memcpy(&bits, &lowest, sizeof(scalar_t));
  });
  return bits;
}

inline void check_attention_mask_inputs(const at::Tensor& parents, const at::Tensor& num_nodes,
                                        const at::Tensor& past_key_mask, at::ScalarType dtype) {
  const char* op = "tree_attention_mask";
  check_tree(op, parents, num_nodes);
  check_tensor(op, "past_key_mask", past_key_mask, at::kBool, 2);
  check_same_device(op, "past_key_mask", past_key_mask, parents, "parents");
  TORCH_CHECK(past_key_mask.size(0) == parents.size(0), op, ": past_key_mask must have batch size ", parents.size(0),
              " (dim 0), got shape ", past_key_mask.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble, op,
              ": dtype must be float32, float16, bfloat16 or float64, got ", dtype);
}

// packed_tree_mask: bits int64[B, N, ceil(N / 64)], seq_lens int64[B], mask_indptr int32[B + 1]
// (byte offsets); on the CPU also the values: lengths >= 0 and every request's byte count
// ceil(N * (seq_len + N) / 8), adding up to total_bytes.
inline void check_packed_tree_mask_inputs(const at::Tensor& bits, const at::Tensor& seq_lens,
                                          const at::Tensor& mask_indptr, int64_t total_bytes) {
  const char* op = "packed_tree_mask";
  check_tensor(op, "bits", bits, at::kLong, 3);
  check_tensor(op, "seq_lens", seq_lens, at::kLong, 1);
  check_tensor(op, "mask_indptr", mask_indptr, at::kInt, 1);
  check_same_device(op, "seq_lens", seq_lens, bits, "bits");
  check_same_device(op, "mask_indptr", mask_indptr, bits, "bits");
  const int64_t batch = bits.size(0), n = bits.size(1);
  TORCH_CHECK_VALUE(n <= kMaxTreeNodes, op, ": at most ", kMaxTreeNodes, " nodes per request, got ", n);
  check_shape(op, "bits", bits, {batch, n, (n + 63) / 64});
  check_shape(op, "seq_lens", seq_lens, {batch});
  check_shape(op, "mask_indptr", mask_indptr, {batch + 1});
  TORCH_CHECK_VALUE(total_bytes >= 0 && total_bytes < (int64_t{1} << 31), op,
                    ": total_bytes must be in [0, 2^31) (int32 offsets), got ", total_bytes);
  TORCH_CHECK_VALUE(!bits.is_cuda() || batch <= 65535, op, ": CUDA takes at most 65535 requests");
  if (!bits.device().is_cpu()) return;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* indptr = mask_indptr.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(batch == 0 || indptr[0] == 0, op, ": mask_indptr[0] must be 0, got ", indptr[0]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] < (int64_t{1} << 40), op, ": seq_lens[", b, "] = ", lens[b],
                      " is not a sequence length");
    const int64_t bytes = (n * (lens[b] + n) + 7) / 8;
    TORCH_CHECK_VALUE(int64_t{indptr[b + 1]} - indptr[b] == bytes, op, ": mask_indptr[", b + 1, "] - mask_indptr[", b,
                      "] must be ceil(N * (seq_lens[b] + N) / 8) = ", bytes, ", got ",
                      int64_t{indptr[b + 1]} - indptr[b]);
  }
  TORCH_CHECK_VALUE(batch == 0 ? total_bytes == 0 : indptr[batch] == total_bytes, op, ": total_bytes (", total_bytes,
                    ") must equal mask_indptr[B] (", batch ? indptr[batch] : 0, ")");
}

constexpr int64_t kMaxHeapBudget = kernels::kMaxHeapBudget;

inline void check_select_top_w_inputs(const at::Tensor& parent_scores, const at::Tensor& child_logprobs,
                                      const at::Tensor& num_parents, int64_t width) {
  const char* op = "select_top_w";
  check_tensor(op, "parent_scores", parent_scores, at::kFloat, 2);
  check_tensor(op, "child_logprobs", child_logprobs, at::kFloat, 3);
  check_tensor(op, "num_parents", num_parents, at::kInt, 1);
  check_same_device(op, "child_logprobs", child_logprobs, parent_scores, "parent_scores");
  check_same_device(op, "num_parents", num_parents, parent_scores, "parent_scores");
  const int64_t batch = parent_scores.size(0), p_max = parent_scores.size(1);
  TORCH_CHECK(child_logprobs.size(0) == batch && child_logprobs.size(1) == p_max, op,
              ": child_logprobs must have shape [B, P, K] with [B, P] = ", parent_scores.sizes(), ", got ",
              child_logprobs.sizes());
  check_shape(op, "num_parents", num_parents, {batch});
  TORCH_CHECK_VALUE(child_logprobs.size(2) >= 1, op, ": child_logprobs needs K >= 1 candidates (dim 2)");
  TORCH_CHECK_VALUE(p_max * child_logprobs.size(2) < (int64_t{1} << 31), op, ": P * K must be below 2^31");
  TORCH_CHECK_VALUE(width >= 1, op, ": width must be >= 1, got ", width);
}

inline void check_select_top_b_inputs(const at::Tensor& parents, const at::Tensor& scores,
                                      const at::Tensor& num_nodes, int64_t budget) {
  const char* op = "select_top_b";
  check_tree(op, parents, num_nodes);
  check_tensor(op, "scores", scores, at::kFloat, 2);
  check_same_device(op, "scores", scores, parents, "parents");
  check_shape(op, "scores", scores, parents.sizes());
  TORCH_CHECK_VALUE(budget >= 0 && budget < (int64_t{1} << 30), op, ": budget must be in [0, 2^30), got ", budget);
}

inline void check_ddtree_heap_inputs(const at::Tensor& logprobs, const at::Tensor& token_ids,
                                     const at::Tensor& root_tokens, int64_t budget) {
  const char* op = "ddtree_heap";
  check_tensor(op, "logprobs", logprobs, at::kFloat, 3);
  check_tensor(op, "token_ids", token_ids, at::kLong, 3);
  check_tensor(op, "root_tokens", root_tokens, at::kLong, 1);
  check_same_device(op, "token_ids", token_ids, logprobs, "logprobs");
  check_same_device(op, "root_tokens", root_tokens, logprobs, "logprobs");
  check_shape(op, "token_ids", token_ids, logprobs.sizes());
  check_shape(op, "root_tokens", root_tokens, {logprobs.size(0)});
  TORCH_CHECK_VALUE(logprobs.size(1) <= 32767, op, ": at most 32767 draft positions (dim 1), got ", logprobs.size(1));
  TORCH_CHECK_VALUE(logprobs.size(2) <= 65536, op, ": at most 65536 candidates per position (dim 2), got ",
                    logprobs.size(2));
  TORCH_CHECK_VALUE(budget >= 0 && budget <= kMaxHeapBudget, op, ": budget must be in [0, ", kMaxHeapBudget,
                    "], got ", budget);
}

// compact_kv_: one cache tensor [B, H, S, Dh] and the moves, all on one device.
inline void check_compact_kv_inputs(const at::Tensor& cache, const char* name, const at::Tensor& src_positions,
                                    const at::Tensor& dst_start, const at::Tensor& lengths) {
  const char* op = "compact_kv_";
  TORCH_CHECK(cache.dim() == 4, op, ": ", name, " must be [B, H, S, Dh], got shape ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), op, ": ", name, " must be contiguous");
  check_same_device(op, name, cache, src_positions, "src_positions");
  const int64_t batch = src_positions.size(0);
  TORCH_CHECK(cache.size(0) == batch, op, ": ", name, " must have batch size ", batch, " (dim 0), got ", cache.sizes());
  TORCH_CHECK(cache.size(2) < (int64_t{1} << 31) && cache.size(3) < (int64_t{1} << 31) && cache.size(1) <= 65535, op,
              ": ", name, " is too large: ", cache.sizes());
}

inline void check_compact_kv_moves(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& src_positions,
                                   const at::Tensor& dst_start, const at::Tensor& lengths) {
  const char* op = "compact_kv_";
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4, op, ": keys and values must be [B, H, S, Dh], got ", keys.sizes(),
              " and ", values.sizes());
  TORCH_CHECK_VALUE(keys.size(0) == values.size(0) && keys.size(1) == values.size(1) && keys.size(2) == values.size(2),
                    op, ": keys ", keys.sizes(), " and values ", values.sizes(),
                    " must agree on [B, H, S] (only the head dim may differ)");
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

// Values, on the CPU: each request moves lengths[b] entries from increasing positions
// src_positions[b, :lengths[b]] >= dst_start[b] to dst_start[b] + i, inside a sequence of `seq`.
inline void check_compact_kv_values_cpu(const at::Tensor& src_positions, const at::Tensor& dst_start,
                                        const at::Tensor& lengths, int64_t seq) {
  const char* op = "compact_kv_";
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

// The correction head's weights, as the expand ops take them.
struct ExpandWeights {
  const at::Tensor& w_s;         // [E, G]
  const at::Tensor& fc2_weight;  // [V, E]
  const std::optional<at::Tensor>& fc2_bias;  // [V]
  const at::Tensor& gru_table;   // [V, 3G]
  const at::Tensor& w_hh;        // [3G, G]
  const std::optional<at::Tensor>& b_hh;      // [3G]
};

inline void check_expand_weights(const char* op, const ExpandWeights& w, const at::Tensor& device_of) {
  const at::ScalarType dtype = w.w_s.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": the head's weights must be float32, bfloat16 or float16, got ", dtype);
  check_tensor(op, "w_s", w.w_s, dtype, 2);
  const int64_t e = w.w_s.size(0), g = w.w_s.size(1);
  check_tensor(op, "fc2_weight", w.fc2_weight, dtype, 2);
  const int64_t v = w.fc2_weight.size(0);
  check_shape(op, "fc2_weight", w.fc2_weight, {v, e});
  check_tensor(op, "gru_table", w.gru_table, dtype, 2);
  check_shape(op, "gru_table", w.gru_table, {v, 3 * g});
  check_tensor(op, "w_hh", w.w_hh, dtype, 2);
  check_shape(op, "w_hh", w.w_hh, {3 * g, g});
  for (const at::Tensor* t : {&w.w_s, &w.fc2_weight, &w.gru_table, &w.w_hh}) check_same_device(op, "a weight", *t, device_of, "z");
  if (w.fc2_bias.has_value()) {
    check_tensor(op, "fc2_bias", *w.fc2_bias, dtype, 1);
    check_shape(op, "fc2_bias", *w.fc2_bias, {v});
    check_same_device(op, "fc2_bias", *w.fc2_bias, device_of, "z");
  }
  if (w.b_hh.has_value()) {
    check_tensor(op, "b_hh", *w.b_hh, dtype, 1);
    check_shape(op, "b_hh", *w.b_hh, {3 * g});
    check_same_device(op, "b_hh", *w.b_hh, device_of, "z");
  }
}

// Head sizes every backend takes: G <= 3040 and E + G + K <= 12000.
inline void check_expand_sizes(const char* op, int64_t e, int64_t g, int64_t k) {
  TORCH_CHECK_VALUE(g <= 3040 && e + g + k <= 12000, op, ": head sizes too large: need G <= 3040 and E + G + K <= 12000,",
                    " got E = ", e, ", G = ", g, ", K = ", k);
}

// The CUDA selection kernel stages the K candidates' and P parents' rows and W-long top lists in
// the 48 KiB of shared memory a block gets without opting in: (K + P) x 33 + 18 W floats.
inline void check_expand_cuda_shared(const char* op, int64_t k, int64_t p_max, int64_t width) {
  TORCH_CHECK_VALUE(kernels::expand_select_shared_floats(k, p_max, width) <= kernels::kExpandSharedLimitFloats, op,
                    ": on CUDA (K + P) x 33 + 18 W must be at most 12288 (shared memory), got K = ", k, ", P = ", p_max,
                    ", W = ", width);
}

inline void check_expand_depth_inputs(const ExpandWeights& w, const at::Tensor& z, const at::Tensor& cand_ids,
                                      const at::Tensor& cand_base, const at::Tensor& parent_states,
                                      const at::Tensor& parent_scores, const at::Tensor& num_parents, int64_t width) {
  const char* op = "expand_depth";
  check_expand_weights(op, w, z);
  const at::ScalarType dtype = w.w_s.scalar_type();
  const int64_t e = w.w_s.size(0), g = w.w_s.size(1);
  check_tensor(op, "z", z, dtype, 2);
  const int64_t batch = z.size(0);
  check_shape(op, "z", z, {batch, e});
  check_tensor(op, "cand_ids", cand_ids, at::kLong, 2);
  TORCH_CHECK(cand_ids.size(0) == batch && cand_ids.size(1) >= 1, op, ": cand_ids must be [B, K] with B = ", batch,
              " and K >= 1, got ", cand_ids.sizes());
  check_tensor(op, "cand_base", cand_base, dtype, 2);
  check_shape(op, "cand_base", cand_base, cand_ids.sizes());
  check_tensor(op, "parent_states", parent_states, at::kFloat, 3);
  TORCH_CHECK(parent_states.size(0) == batch && parent_states.size(2) == g, op,
              ": parent_states must be float32 [B, P, G] with B = ", batch, " and G = ", g, ", got ",
              parent_states.sizes());
  check_tensor(op, "parent_scores", parent_scores, at::kFloat, 2);
  check_shape(op, "parent_scores", parent_scores, {batch, parent_states.size(1)});
  check_tensor(op, "num_parents", num_parents, at::kInt, 1);
  check_shape(op, "num_parents", num_parents, {batch});
  for (const at::Tensor* t : {&cand_ids, &cand_base, &parent_states, &parent_scores, &num_parents})
    check_same_device(op, "an input", *t, z, "z");
  TORCH_CHECK_VALUE(width >= 0, op, ": width must be >= 0, got ", width);
  check_expand_sizes(op, e, g, cand_ids.size(1));
  TORCH_CHECK_VALUE(parent_states.size(1) * cand_ids.size(1) < (int64_t{1} << 31), op, ": P * K must be below 2^31");
  TORCH_CHECK_VALUE(!z.is_cuda() || (batch <= 65535 && parent_states.size(1) <= 65535 && width <= 65535), op,
                    ": CUDA kernels take at most 65535 requests, parents and children per call");
  if (z.is_cuda()) check_expand_cuda_shared(op, cand_ids.size(1), parent_states.size(1), width);
}

inline void check_build_supertree_inputs(const ExpandWeights& w, const at::Tensor& z, const at::Tensor& cand_ids,
                                         const at::Tensor& cand_base, const at::Tensor& root_state,
                                         at::IntArrayRef widths) {
  const char* op = "build_supertree";
  check_expand_weights(op, w, z);
  const at::ScalarType dtype = w.w_s.scalar_type();
  const int64_t e = w.w_s.size(0), g = w.w_s.size(1);
  check_tensor(op, "z", z, dtype, 3);
  const int64_t batch = z.size(0), depth = z.size(1);
  check_shape(op, "z", z, {batch, depth, e});
  check_tensor(op, "cand_ids", cand_ids, at::kLong, 3);
  TORCH_CHECK(cand_ids.size(0) == batch && cand_ids.size(1) == depth && cand_ids.size(2) >= 1, op,
              ": cand_ids must be [B, D, K] with [B, D] = [", batch, ", ", depth, "] and K >= 1, got ",
              cand_ids.sizes());
  check_tensor(op, "cand_base", cand_base, dtype, 3);
  check_shape(op, "cand_base", cand_base, cand_ids.sizes());
  check_tensor(op, "root_state", root_state, dtype, 2);
  check_shape(op, "root_state", root_state, {batch, g});
  for (const at::Tensor* t : {&cand_ids, &cand_base, &root_state}) check_same_device(op, "an input", *t, z, "z");
  TORCH_CHECK_VALUE(static_cast<int64_t>(widths.size()) == depth, op, ": widths must give one width per depth (",
                    depth, "), got ", widths.size());
  for (int64_t width : widths) {
    TORCH_CHECK_VALUE(width >= 1 && width <= 65535, op, ": every width must be in [1, 65535], got ", width);
    TORCH_CHECK_VALUE(width * cand_ids.size(2) < (int64_t{1} << 31), op, ": width * K must be below 2^31");
  }
  check_expand_sizes(op, e, g, cand_ids.size(2));
  TORCH_CHECK_VALUE(!z.is_cuda() || batch <= 65535, op, ": CUDA kernels take at most 65535 requests per call");
  if (z.is_cuda()) {
    int64_t widest = 1;
    for (int64_t width : widths) widest = width > widest ? width : widest;
    check_expand_cuda_shared(op, cand_ids.size(2), widest, widest);
  }
}

// build_supertree's outputs, [B, sum(widths)] depth-major, on cand_ids' device; both backends.
struct SupertreeOutputs {
  at::Tensor tokens, parents, depths, scores;
  int64_t total;
};

inline SupertreeOutputs allocate_supertree(const at::Tensor& cand_ids, at::IntArrayRef widths) {
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  const int64_t batch = cand_ids.size(0);
  return {at::empty({batch, total}, cand_ids.options()), at::empty({batch, total}, cand_ids.options().dtype(at::kInt)),
          at::empty({batch, total}, cand_ids.options().dtype(at::kInt)),
          at::empty({batch, total}, cand_ids.options().dtype(at::kFloat)), total};
}

// Defined in cpu/verify.cpp, used by both backends.
void check_verify_inputs(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& num_nodes,
                         const at::Tensor& target_tokens);

}  // namespace dartree
