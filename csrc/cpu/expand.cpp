// CPU kernels for DARTree's depth-wise expansion with a GRU correction head: expand_depth (one
// depth) and build_supertree (all depths in one call). Same math, order and padding as
// csrc/kernels/expand.cuh; accumulation in float32 whatever the weights' dtype. Unlike the GPU,
// where one block per parent / child does everything, the CPU batches the dense algebra of a
// depth into three matmuls (BLAS) and fuses the rest into one pass per request.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "../checks/expand.h"
#include "../kernels/score_order.h"
#include "vec_math.h"

namespace dartree {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// h' = (1 - u) n + u h with r, u, n from the input gates gi (a gru_table row) and hidden gates gh.
DARTREE_VEC_INLINE void gru_cell_impl(const float* gi, const float* gh, const float* h, float* out, int64_t g) {
#pragma omp simd
  for (int64_t j = 0; j < g; ++j) {
    const float r = vsigmoid(gi[j] + gh[j]);
    const float u = vsigmoid(gi[g + j] + gh[g + j]);
    const float n = vtanh(gi[2 * g + j] + r * gh[2 * g + j]);
    out[j] = (1.0f - u) * n + u * h[j];
  }
}
DARTREE_AVX2_DISPATCH(void, gru_cell, (const float* gi, const float* gh, const float* h, float* out, int64_t g), (gi, gh, h, out, g))

struct Scored {
  float score;
  int32_t index;
  bool operator<(const Scored& o) const { return score_order::before(score, index, o.score, o.index); }
};

// HeadWeights prepared for the CPU: the head's small matrices as float32 (no copy when they already
// are), transposed as views: BLAS takes the transposed operand as is. fc2 and gru_table stay as
// they are: only the K candidate rows (and the chosen tokens' rows) are ever read.
struct CpuHeadWeights {
  at::Tensor w_s_t;   // [G, E]
  at::Tensor w_hh_t;  // [G, 3G]
  at::Tensor b_hh;    // [3G] or undefined
  const HeadWeights& weights;

  explicit CpuHeadWeights(const HeadWeights& w)
      : w_s_t(w.w_s.to(at::kFloat).t()),
        w_hh_t(w.w_hh.to(at::kFloat).t()),
        b_hh(w.b_hh.has_value() ? w.b_hh->to(at::kFloat) : at::Tensor()),
        weights(w) {}
};

struct DepthOut {  // the depth's W children of request b sit at `stride * b` from each pointer
  int32_t* parent_idx;
  int32_t* child_k;  // or null
  float* scores;
  int64_t* tokens;
  int32_t* depths;  // or null
  int64_t stride;
  int parent_offset, depth_value;
};

// One depth for the whole batch. The dense algebra (state -> hidden, hidden -> candidate logits,
// state -> GRU hidden gates, once per parent that got a child) runs as three matmuls; top-W and
// the gate math run in parallel passes. Returns the children's states [B, W, G] (undefined when
// `need_states` is false: the last depth's children are never expanded) and writes each request's
// child count.
at::Tensor expand_batch(const CpuHeadWeights& head, const at::Tensor& z, const at::Tensor& cand_ids,
                        const at::Tensor& cand_base, const at::Tensor& states, const float* parent_scores,
                        int64_t parent_score_stride, const int32_t* num_parents, int64_t width, float depth_bonus,
                        const DepthOut& out, int32_t* num_children, bool need_states = true) {
  const int64_t batch = states.size(0), p_max = states.size(1), g = states.size(2), k = cand_ids.size(1);
  const HeadWeights& w = head.weights;
  const at::Tensor ids_c = cand_ids.contiguous();
  at::Tensor hidden = at::matmul(states, head.w_s_t);  // [B, P, E]
  hidden.add_(z.to(at::kFloat).unsqueeze(1));
  at::silu_(hidden);
  const at::Tensor flat_ids = ids_c.view({-1});
  at::Tensor rows = w.fc2_weight.index_select(0, flat_ids).to(at::kFloat).view({batch, k, -1});  // [B, K, E]
  at::Tensor base = cand_base.to(at::kFloat);
  if (w.fc2_bias.has_value()) base = base + w.fc2_bias->index_select(0, flat_ids).to(at::kFloat).view({batch, k});
  const at::Tensor logits =
      at::baddbmm(base.unsqueeze(1).expand({batch, p_max, k}), hidden, rows.transpose(1, 2)).contiguous();
  const float* lg = logits.data_ptr<float>();
  const float* st = states.data_ptr<float>();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  // selection first, so that the GRU's hidden gates are computed only for parents that got a child
  std::vector<int32_t> chosen_parent(batch * width, -1);  // flat b * P + p, or -1 for padding
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<Scored> candidates;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t parents_here = num_parents[b];
      candidates.resize(parents_here * k);
      for (int64_t p = 0; p < parents_here; ++p) {
        const float* row = lg + (b * p_max + p) * k;  // log-softmax over the K candidates, fused here
        float max_logit = kNegInf;
        for (int64_t c = 0; c < k; ++c) max_logit = std::max(max_logit, row[c]);
        float sum = 0.0f;
        for (int64_t c = 0; c < k; ++c) sum += std::exp(row[c] - max_logit);
        const float offset = parent_scores[b * parent_score_stride + p] + depth_bonus - (max_logit + std::log(sum));
        for (int64_t c = 0; c < k; ++c) {
          const float s = row[c] + offset;
          candidates[p * k + c] = {score_order::sanitize(s), static_cast<int32_t>(p * k + c)};
        }
      }
      const int64_t take = std::min<int64_t>(width, parents_here * k);
      std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end());
      num_children[b] = static_cast<int32_t>(take);
      const int64_t row = b * out.stride;
      for (int64_t i = 0; i < width; ++i) {
        if (i >= take) {
          out.parent_idx[row + i] = -1;
          if (out.child_k) out.child_k[row + i] = -1;
          out.scores[row + i] = kNegInf;
          out.tokens[row + i] = 0;
          if (out.depths) out.depths[row + i] = -1;
          continue;
        }
        const int64_t p = candidates[i].index / k, c = candidates[i].index % k;
        chosen_parent[b * width + i] = static_cast<int32_t>(b * p_max + p);
        out.parent_idx[row + i] = static_cast<int32_t>(p + out.parent_offset);
        if (out.child_k) out.child_k[row + i] = static_cast<int32_t>(c);
        out.scores[row + i] = candidates[i].score;
        out.tokens[row + i] = ids[b * k + c];
        if (out.depths) out.depths[row + i] = out.depth_value;
      }
    }
  });
  if (!need_states) return at::Tensor();
  at::Tensor child_states = at::empty({batch, width, g}, states.options());
  float* cs = child_states.data_ptr<float>();
  std::vector<int64_t> distinct;  // parents with at least one child, and each child's row among them
  std::vector<int64_t> gate_row(batch * width, -1);
  std::vector<int64_t> row_of(batch * p_max, -1);
  for (int64_t i = 0; i < batch * width; ++i) {
    const int32_t parent = chosen_parent[i];
    if (parent < 0) continue;
    if (row_of[parent] < 0) {
      row_of[parent] = static_cast<int64_t>(distinct.size());
      distinct.push_back(parent);
    }
    gate_row[i] = row_of[parent];
  }
  at::Tensor gh;
  if (!distinct.empty()) {
    const at::Tensor rows_idx = at::from_blob(distinct.data(), {static_cast<int64_t>(distinct.size())}, at::kLong);
    gh = at::matmul(states.view({batch * p_max, g}).index_select(0, rows_idx), head.w_hh_t);  // [n, 3G]
    if (head.b_hh.defined()) gh += head.b_hh;
    gh = gh.contiguous();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.gru_table.scalar_type(), "expand_batch", [&] {
    const scalar_t* table = w.gru_table.data_ptr<scalar_t>();
    at::parallel_for(0, batch * width, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(std::is_same_v<scalar_t, float> ? 0 : 3 * g);
      for (int64_t i = begin; i < end; ++i) {
        float* state_out = cs + i * g;
        if (gate_row[i] < 0) {
          std::fill(state_out, state_out + g, 0.0f);
          continue;
        }
        const int64_t b = i / width;
        const float* h = st + chosen_parent[i] * g;
        const float* gates = gh.data_ptr<float>() + gate_row[i] * 3 * g;
        const scalar_t* gi = table + out.tokens[b * out.stride + i % width] * 3 * g;
        gru_cell(as_float(gi, 3 * g, row.data()), gates, h, state_out, g);
      }
    });
  });
  return child_states;
}

// Candidate ids must be rows of the head (the CUDA kernels instead score an out-of-range id -inf
// without reading it, as they cannot raise without a synchronization).
void check_cand_ids_cpu(const char* op, const at::Tensor& cand_ids, int64_t vocab) {
  const int64_t* ids = cand_ids.data_ptr<int64_t>();
  for (int64_t i = 0, n = cand_ids.numel(); i < n; ++i)
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < vocab, op, ": cand_ids must be token ids in [0, ", vocab,
                      ") (rows of fc2_weight), got ", ids[i], " at flat index ", i);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_depth_cpu(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& parent_states,
    const at::Tensor& parent_scores, const at::Tensor& num_parents, const at::Tensor& w_s, const at::Tensor& fc2_weight,
    const std::optional<at::Tensor>& fc2_bias, const at::Tensor& gru_table, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_hh, int64_t width, double depth_bonus) {
  const HeadWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_expand_depth_inputs(weights, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width);
  check_cand_ids_cpu("expand_depth", cand_ids, fc2_weight.size(0));
  const int64_t batch = z.size(0), p_max = parent_states.size(1);
  const int32_t* counts = num_parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(counts[b] >= 0 && counts[b] <= p_max, "expand_depth: num_parents[", b, "] = ", counts[b],
                      " is outside [0, ", p_max, "]");
  at::Tensor parent_idx = at::empty({batch, width}, num_parents.options());
  at::Tensor child_k = at::empty({batch, width}, num_parents.options());
  at::Tensor scores = at::empty({batch, width}, parent_scores.options());
  at::Tensor tokens = at::empty({batch, width}, cand_ids.options());
  std::vector<int32_t> num_children(batch);
  const DepthOut out{parent_idx.data_ptr<int32_t>(), child_k.data_ptr<int32_t>(), scores.data_ptr<float>(),
                     tokens.data_ptr<int64_t>(), nullptr, width, 0, 0};
  at::Tensor states = expand_batch(CpuHeadWeights(weights), z, cand_ids, cand_base, parent_states,
                                   parent_scores.data_ptr<float>(), p_max, counts, width,
                                   static_cast<float>(depth_bonus), out, num_children.data());
  return {parent_idx, child_k, scores, tokens, states};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_supertree_cpu(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& root_state,
    const at::Tensor& w_s, const at::Tensor& fc2_weight, const std::optional<at::Tensor>& fc2_bias,
    const at::Tensor& gru_table, const at::Tensor& w_hh, const std::optional<at::Tensor>& b_hh, at::IntArrayRef widths,
    double depth_bonus) {
  const HeadWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_build_supertree_inputs(weights, z, cand_ids, cand_base, root_state, widths);
  check_cand_ids_cpu("build_supertree", cand_ids, fc2_weight.size(0));
  const int64_t batch = z.size(0), depth = z.size(1);
  auto [tokens, parents, depths, scores, total] = allocate_supertree(cand_ids, widths);
  const CpuHeadWeights head(weights);
  at::Tensor states = root_state.to(at::kFloat).unsqueeze(1).contiguous();  // [B, 1, G]
  const std::vector<float> root_scores(batch, 0.0f);
  std::vector<int32_t> counts[2] = {std::vector<int32_t>(batch, 1), std::vector<int32_t>(batch)};
  int64_t offset = 0, parent_offset = -1;
  for (int64_t d = 0; d < depth; ++d) {
    const DepthOut out{parents.data_ptr<int32_t>() + offset, nullptr, scores.data_ptr<float>() + offset,
                       tokens.data_ptr<int64_t>() + offset, depths.data_ptr<int32_t>() + offset, total,
                       static_cast<int>(parent_offset), static_cast<int>(d + 1)};
    const float* parent_scores = d == 0 ? root_scores.data() : scores.data_ptr<float>() + parent_offset;
    states = expand_batch(head, z.select(1, d), cand_ids.select(1, d), cand_base.select(1, d), states, parent_scores,
                          d == 0 ? 1 : total, counts[d % 2].data(), widths[d], static_cast<float>(depth_bonus), out,
                          counts[1 - d % 2].data(), d + 1 < depth);
    parent_offset = offset;
    offset += widths[d];
  }
  return {tokens, parents, depths, scores};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("expand_depth", &expand_depth_cpu);
  m.impl("build_supertree", &build_supertree_cpu);
}

}  // namespace dartree
