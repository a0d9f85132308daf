// CPU kernels for the selection ops: select_top_w, select_top_b and ddtree_heap.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <vector>

#include "../checks/select.h"
#include "../kernels/score_order.h"

namespace dartree {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The order shared with the CUDA kernels (kernels/score_order.h).
float sanitize(float s) { return score_order::sanitize(s); }

struct Scored {
  float score;
  int32_t index;
  bool operator<(const Scored& o) const { return score_order::before(score, index, o.score, o.index); }  // "comes first"
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_top_w_cpu(const at::Tensor& parent_scores,
                                                                 const at::Tensor& child_logprobs,
                                                                 const at::Tensor& num_parents, int64_t width) {
  check_select_top_w_inputs(parent_scores, child_logprobs, num_parents, width);
  const int64_t batch = parent_scores.size(0), p_max = parent_scores.size(1), k = child_logprobs.size(2);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = num_parents.data_ptr<int32_t>()[b];
    TORCH_CHECK_VALUE(count >= 0 && count <= p_max, "select_top_w: num_parents[", b, "] = ", count,
                      " is outside [0, ", p_max, "]");
  }
  at::Tensor parent_idx = at::full({batch, width}, -1, num_parents.options());
  at::Tensor child_k = at::full({batch, width}, -1, num_parents.options());
  at::Tensor scores = at::full({batch, width}, kNegInf, parent_scores.options());
  const float* ps = parent_scores.data_ptr<float>();
  const float* cl = child_logprobs.data_ptr<float>();
  const int32_t* counts = num_parents.data_ptr<int32_t>();
  int32_t* out_p = parent_idx.data_ptr<int32_t>();
  int32_t* out_k = child_k.data_ptr<int32_t>();
  float* out_s = scores.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<Scored> candidates;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t count = counts[b] * k;
      candidates.resize(count);
      for (int64_t c = 0; c < count; ++c)
        candidates[c] = {sanitize(ps[b * p_max + c / k] + cl[b * p_max * k + c]), static_cast<int32_t>(c)};
      const int64_t take = std::min<int64_t>(width, count);
      std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end());
      for (int64_t t = 0; t < take; ++t) {
        out_p[b * width + t] = static_cast<int32_t>(candidates[t].index / k);
        out_k[b * width + t] = static_cast<int32_t>(candidates[t].index % k);
        out_s[b * width + t] = candidates[t].score;
      }
    }
  });
  return {parent_idx, child_k, scores};
}

// Marks the kept nodes of one request. Monotone scores (never higher than the parent's): the
// `budget` best non-root nodes in the total order (Lemma 1). Otherwise a best-first heap over the
// frontier of kept nodes' children, which is prefix-closed by construction.
void select_request(const int32_t* parents, const float* raw_scores, int64_t n, int64_t budget,
                    std::vector<Scored>& scratch, std::vector<uint8_t>& kept) {
  kept.assign(n, 0);
  kept[0] = 1;
  bool monotone = true;
  for (int64_t i = 1; i < n && monotone; ++i) monotone = sanitize(raw_scores[i]) <= sanitize(raw_scores[parents[i]]);
  scratch.clear();
  if (monotone) {
    for (int64_t i = 1; i < n; ++i) scratch.push_back({sanitize(raw_scores[i]), static_cast<int32_t>(i)});
    const int64_t take = std::min<int64_t>(budget, n - 1);
    std::nth_element(scratch.begin(), scratch.begin() + take, scratch.end());
    for (int64_t t = 0; t < take; ++t) kept[scratch[t].index] = 1;
    return;
  }
  std::vector<int32_t> first_child(n, -1), next_sibling(n, -1);
  for (int64_t i = n - 1; i >= 1; --i) {
    next_sibling[i] = first_child[parents[i]];
    first_child[parents[i]] = static_cast<int32_t>(i);
  }
  // std::priority_queue pops the largest: invert "comes first"
  auto later = [](const Scored& a, const Scored& b) { return b < a; };
  std::priority_queue<Scored, std::vector<Scored>, decltype(later)> frontier(later);
  for (int32_t c = first_child[0]; c >= 0; c = next_sibling[c]) frontier.push({sanitize(raw_scores[c]), c});
  for (int64_t popped = 0; popped < budget && !frontier.empty(); ++popped) {
    const int32_t node = frontier.top().index;
    frontier.pop();
    kept[node] = 1;
    for (int32_t c = first_child[node]; c >= 0; c = next_sibling[c]) frontier.push({sanitize(raw_scores[c]), c});
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_top_b_cpu(const at::Tensor& parents, const at::Tensor& scores,
                                                                 const at::Tensor& num_nodes, int64_t budget) {
  check_select_top_b_inputs(parents, scores, num_nodes, budget);
  const int64_t batch = parents.size(0), n_max = parents.size(1), slots = budget + 1;
  at::Tensor keep = at::full({batch, slots}, -1, parents.options());
  at::Tensor new_parents = at::full({batch, slots}, -1, parents.options());
  at::Tensor num_kept = at::empty({batch}, parents.options());
  const int32_t* par = parents.data_ptr<int32_t>();
  const float* sc = scores.data_ptr<float>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  int32_t* out_keep = keep.data_ptr<int32_t>();
  int32_t* out_parents = new_parents.data_ptr<int32_t>();
  int32_t* out_count = num_kept.data_ptr<int32_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<Scored> scratch;
    std::vector<uint8_t> kept;
    std::vector<int32_t> new_index;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = counts[b];
      const int32_t* row_parents = par + b * n_max;
      select_request(row_parents, sc + b * n_max, n, budget, scratch, kept);
      new_index.assign(n, -1);
      int32_t slot = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (!kept[i]) continue;
        new_index[i] = slot;
        out_keep[b * slots + slot] = static_cast<int32_t>(i);
        out_parents[b * slots + slot] = i == 0 ? -1 : new_index[row_parents[i]];
        ++slot;
      }
      out_count[b] = slot;
    }
  });
  return {keep, new_parents, num_kept};
}

struct HeapEntry {
  float score;
  int32_t seq;
  int32_t parent;
  int32_t depth;
  int32_t rank;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ddtree_heap_cpu(
    const at::Tensor& logprobs, const at::Tensor& token_ids, const at::Tensor& root_tokens, int64_t budget) {
  check_ddtree_heap_inputs(logprobs, token_ids, root_tokens, budget);
  const int64_t batch = logprobs.size(0), depth_max = logprobs.size(1), k = logprobs.size(2), slots = budget + 1;
  const float* lp = logprobs.data_ptr<float>();
  const int64_t* ids_in = token_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(root_tokens.data_ptr<int64_t>()[b] >= 0, "ddtree_heap: root_tokens[", b, "] = ",
                      root_tokens.data_ptr<int64_t>()[b], " is not a token id (negative)");
  for (int64_t i = 0; i < batch * depth_max * k; ++i)
    TORCH_CHECK_VALUE(ids_in[i] >= 0, "ddtree_heap: token_ids[", i / (depth_max * k), ", ", (i / k) % depth_max, ", ",
                      i % k, "] = ", ids_in[i], " is not a token id (negative)");
  for (int64_t row = 0; row < batch * depth_max; ++row)
    TORCH_CHECK_VALUE(k == 0 || (!std::isnan(lp[row * k]) && lp[row * k] != std::numeric_limits<float>::infinity()),
                      "ddtree_heap: logprobs[", row / depth_max, ", ", row % depth_max, ", 0] = ", lp[row * k],
                      " is not a log-probability (NaN or +inf)");
  for (int64_t row = 0; row < batch * depth_max; ++row)
    for (int64_t j = 1; j < k; ++j)
      TORCH_CHECK_VALUE(lp[row * k + j - 1] >= lp[row * k + j], "ddtree_heap: logprobs[", row / depth_max, ", ",
                        row % depth_max, "] must be sorted in descending order (and free of NaN); entries ", j - 1,
                        " and ", j, " are ", lp[row * k + j - 1], " and ", lp[row * k + j]);
  // outputs are filled in the loop (padding included): no separate initialization pass
  at::Tensor tokens = at::empty({batch, slots}, token_ids.options());
  at::Tensor parents = at::empty({batch, slots}, logprobs.options().dtype(at::kInt));
  at::Tensor depths = at::empty({batch, slots}, logprobs.options().dtype(at::kInt));
  at::Tensor scores = at::empty({batch, slots}, logprobs.options());
  at::Tensor num_nodes = at::empty({batch}, logprobs.options().dtype(at::kInt));
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int64_t* roots = root_tokens.data_ptr<int64_t>();
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  int32_t* out_parents = parents.data_ptr<int32_t>();
  int32_t* out_depths = depths.data_ptr<int32_t>();
  float* out_scores = scores.data_ptr<float>();
  int32_t* out_count = num_nodes.data_ptr<int32_t>();
  // ties in score go to the earlier push, as in the CUDA kernel and the heapq reference
  auto later = [](const HeapEntry& a, const HeapEntry& b) {
    return a.score < b.score || (a.score == b.score && a.seq > b.seq);
  };
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<HeapEntry> heap;  // std::push_heap / pop_heap: the best entry at the front
    heap.reserve(budget + 2);     // a pop pushes at most two, so the heap never exceeds budget + 1
    auto push = [&](const HeapEntry& e) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), later);
    };
    for (int64_t b = begin; b < end; ++b) {
      heap.clear();
      const float* row_lp = lp + b * depth_max * k;
      const int64_t* row_ids = ids + b * depth_max * k;
      const int64_t base = b * slots;
      out_tokens[base] = roots[b];
      out_parents[base] = -1;
      out_depths[base] = 0;
      out_scores[base] = 0.0f;
      int32_t seq = 0, count = 1;
      if (budget > 0 && depth_max > 0 && k > 0) push({row_lp[0], seq++, 0, 1, 0});
      while (count <= budget && !heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), later);
        const HeapEntry e = heap.back();
        heap.pop_back();
        const int32_t node = count++;
        out_tokens[base + node] = row_ids[(e.depth - 1) * k + e.rank];
        out_parents[base + node] = e.parent;
        out_depths[base + node] = e.depth;
        out_scores[base + node] = e.score;
        if (count > budget) break;
        if (e.rank + 1 < k)
          push({out_scores[base + e.parent] + row_lp[(e.depth - 1) * k + e.rank + 1], seq++, e.parent, e.depth,
                e.rank + 1});
        if (e.depth < depth_max) push({e.score + row_lp[e.depth * k], seq++, node, e.depth + 1, 0});
      }
      out_count[b] = count;
      std::fill(out_tokens + base + count, out_tokens + base + slots, 0);
      std::fill(out_parents + base + count, out_parents + base + slots, -1);
      std::fill(out_depths + base + count, out_depths + base + slots, -1);
      std::fill(out_scores + base + count, out_scores + base + slots, kNegInf);
    }
  });
  return {tokens, parents, depths, scores, num_nodes};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("select_top_w", &select_top_w_cpu);
  m.impl("select_top_b", &select_top_b_cpu);
  m.impl("ddtree_heap", &ddtree_heap_cpu);
}

}  // namespace dartree
