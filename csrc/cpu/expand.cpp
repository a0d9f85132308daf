// CPU kernels for DARTree's depth-wise expansion with a GRU correction head: expand_depth (one
// depth) and build_supertree (all depths in one call). Same math, order and padding as
// csrc/kernels/expand.cuh; accumulation in float32 whatever the weights' dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../op_utils.h"

namespace dartree {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
float dot(const T* a, const float* x, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(a[i]) * x[i];
  return acc;
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

struct Scored {
  float score;
  int32_t index;
  bool operator<(const Scored& o) const { return score > o.score || (score == o.score && index < o.index); }
};

template <typename T>
struct Head {
  const T *w_s, *fc2_weight, *fc2_bias, *gru_table, *w_hh, *b_hh;
  int64_t e, g;
};

struct DepthOut {  // one request's row of the depth's outputs
  int32_t* parent_idx;
  int32_t* child_k;  // or null
  float* scores;
  int64_t* tokens;
  int32_t* depths;   // or null
  float* child_states;  // [W, G]
  int parent_offset, depth_value;
};

// One depth of one request. `candidates` and the float buffers are scratch reused across calls.
template <typename T>
int64_t expand_request(const Head<T>& head, const T* z, const int64_t* ids, const T* base, const float* parent_states,
                       const float* parent_scores, int64_t num_parents, int64_t k, int64_t width, float depth_bonus,
                       std::vector<Scored>& candidates, std::vector<float>& scratch, const DepthOut& out) {
  const int64_t e = head.e, g = head.g;
  scratch.resize(e + k + 3 * g);
  float* hidden = scratch.data();
  float* logits = hidden + e;
  float* gh = logits + k;
  candidates.resize(num_parents * k);
  for (int64_t p = 0; p < num_parents; ++p) {
    const float* state = parent_states + p * g;
    for (int64_t j = 0; j < e; ++j) {
      const float a = static_cast<float>(z[j]) + dot(head.w_s + j * g, state, g);
      hidden[j] = a * sigmoid(a);
    }
    float max_logit = kNegInf;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t id = ids[c];
      logits[c] = static_cast<float>(base[c]) + dot(head.fc2_weight + id * e, hidden, e) +
                  (head.fc2_bias != nullptr ? static_cast<float>(head.fc2_bias[id]) : 0.0f);
      max_logit = std::max(max_logit, logits[c]);
    }
    float sum = 0.0f;
    for (int64_t c = 0; c < k; ++c) sum += std::exp(logits[c] - max_logit);
    const float offset = parent_scores[p] + depth_bonus - (max_logit + std::log(sum));
    for (int64_t c = 0; c < k; ++c) {
      const float s = logits[c] + offset;
      candidates[p * k + c] = {std::isnan(s) ? kNegInf : s, static_cast<int32_t>(p * k + c)};
    }
  }
  const int64_t take = std::min<int64_t>(width, num_parents * k);
  std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end());
  for (int64_t w = 0; w < width; ++w) {
    float* state_out = out.child_states + w * g;
    if (w >= take) {
      out.parent_idx[w] = -1;
      if (out.child_k) out.child_k[w] = -1;
      out.scores[w] = kNegInf;
      out.tokens[w] = 0;
      if (out.depths) out.depths[w] = -1;
      std::fill(state_out, state_out + g, 0.0f);
      continue;
    }
    const int64_t p = candidates[w].index / k, c = candidates[w].index % k, token = ids[c];
    out.parent_idx[w] = static_cast<int32_t>(p + out.parent_offset);
    if (out.child_k) out.child_k[w] = static_cast<int32_t>(c);
    out.scores[w] = candidates[w].score;
    out.tokens[w] = token;
    if (out.depths) out.depths[w] = out.depth_value;
    const float* h = parent_states + p * g;
    for (int64_t r = 0; r < 3 * g; ++r)
      gh[r] = dot(head.w_hh + r * g, h, g) + (head.b_hh != nullptr ? static_cast<float>(head.b_hh[r]) : 0.0f);
    const T* gi = head.gru_table + token * 3 * g;
    for (int64_t j = 0; j < g; ++j) {
      const float rg = sigmoid(static_cast<float>(gi[j]) + gh[j]);
      const float u = sigmoid(static_cast<float>(gi[g + j]) + gh[g + j]);
      const float n = std::tanh(static_cast<float>(gi[2 * g + j]) + rg * gh[2 * g + j]);
      state_out[j] = (1.0f - u) * n + u * h[j];
    }
  }
  return take;
}

template <typename T>
Head<T> head_of(const ExpandWeights& w) {
  return Head<T>{w.w_s.data_ptr<T>(),
                 w.fc2_weight.data_ptr<T>(),
                 w.fc2_bias.has_value() ? w.fc2_bias->data_ptr<T>() : nullptr,
                 w.gru_table.data_ptr<T>(),
                 w.w_hh.data_ptr<T>(),
                 w.b_hh.has_value() ? w.b_hh->data_ptr<T>() : nullptr,
                 w.w_s.size(0),
                 w.w_s.size(1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_depth_cpu(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& parent_states,
    const at::Tensor& parent_scores, const at::Tensor& num_parents, const at::Tensor& w_s, const at::Tensor& fc2_weight,
    const std::optional<at::Tensor>& fc2_bias, const at::Tensor& gru_table, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_hh, int64_t width, double depth_bonus) {
  const ExpandWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_expand_depth_inputs(weights, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width);
  const int64_t batch = z.size(0), p_max = parent_states.size(1), k = cand_ids.size(1), g = w_s.size(1);
  const int32_t* counts = num_parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(counts[b] >= 0 && counts[b] <= p_max, "expand_depth: num_parents[", b, "] = ", counts[b],
                      " is outside [0, ", p_max, "]");
  at::Tensor parent_idx = at::empty({batch, width}, num_parents.options());
  at::Tensor child_k = at::empty({batch, width}, num_parents.options());
  at::Tensor scores = at::empty({batch, width}, parent_scores.options());
  at::Tensor tokens = at::empty({batch, width}, cand_ids.options());
  at::Tensor states = at::empty({batch, width, g}, parent_states.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w_s.scalar_type(), "expand_depth_cpu", [&] {
    const Head<scalar_t> head = head_of<scalar_t>(weights);
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<Scored> candidates;
      std::vector<float> scratch;
      for (int64_t b = begin; b < end; ++b) {
        const DepthOut out{parent_idx.data_ptr<int32_t>() + b * width, child_k.data_ptr<int32_t>() + b * width,
                           scores.data_ptr<float>() + b * width,       tokens.data_ptr<int64_t>() + b * width,
                           nullptr,                                     states.data_ptr<float>() + b * width * g,
                           0,                                           0};
        expand_request(head, z.data_ptr<scalar_t>() + b * z.size(1), cand_ids.data_ptr<int64_t>() + b * k,
                       cand_base.data_ptr<scalar_t>() + b * k, parent_states.data_ptr<float>() + b * p_max * g,
                       parent_scores.data_ptr<float>() + b * p_max, counts[b], k, width,
                       static_cast<float>(depth_bonus), candidates, scratch, out);
      }
    });
  });
  return {parent_idx, child_k, scores, tokens, states};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_supertree_cpu(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& root_state,
    const at::Tensor& w_s, const at::Tensor& fc2_weight, const std::optional<at::Tensor>& fc2_bias,
    const at::Tensor& gru_table, const at::Tensor& w_hh, const std::optional<at::Tensor>& b_hh, at::IntArrayRef widths,
    double depth_bonus) {
  const ExpandWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_build_supertree_inputs(weights, z, cand_ids, cand_base, root_state, widths);
  const int64_t batch = z.size(0), depth = z.size(1), e = z.size(2), k = cand_ids.size(2), g = w_s.size(1);
  int64_t total = 0, max_width = 1;
  for (int64_t w : widths) {
    total += w;
    max_width = std::max(max_width, w);
  }
  at::Tensor tokens = at::empty({batch, total}, cand_ids.options());
  at::Tensor parents = at::empty({batch, total}, cand_ids.options().dtype(at::kInt));
  at::Tensor depths = at::empty({batch, total}, cand_ids.options().dtype(at::kInt));
  at::Tensor scores = at::empty({batch, total}, cand_ids.options().dtype(at::kFloat));
  const at::Tensor root = root_state.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w_s.scalar_type(), "build_supertree_cpu", [&] {
    const Head<scalar_t> head = head_of<scalar_t>(weights);
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<Scored> candidates;
      std::vector<float> scratch;
      std::vector<float> states_a(max_width * g), states_b(max_width * g), scores_prev(max_width);
      for (int64_t b = begin; b < end; ++b) {
        std::copy(root.data_ptr<float>() + b * g, root.data_ptr<float>() + (b + 1) * g, states_a.begin());
        scores_prev[0] = 0.0f;
        int64_t num_parents = 1, offset = 0, parent_offset = -1;
        const int64_t row = b * total;
        for (int64_t d = 0; d < depth; ++d) {
          const int64_t width = widths[d];
          const DepthOut out{parents.data_ptr<int32_t>() + row + offset, nullptr,
                             scores.data_ptr<float>() + row + offset,   tokens.data_ptr<int64_t>() + row + offset,
                             depths.data_ptr<int32_t>() + row + offset, states_b.data(),
                             static_cast<int>(parent_offset),           static_cast<int>(d + 1)};
          num_parents = expand_request(head, z.data_ptr<scalar_t>() + (b * depth + d) * e,
                                       cand_ids.data_ptr<int64_t>() + (b * depth + d) * k,
                                       cand_base.data_ptr<scalar_t>() + (b * depth + d) * k, states_a.data(),
                                       scores_prev.data(), num_parents, k, width, static_cast<float>(depth_bonus),
                                       candidates, scratch, out);
          std::copy(scores.data_ptr<float>() + row + offset, scores.data_ptr<float>() + row + offset + width,
                    scores_prev.begin());
          std::swap(states_a, states_b);
          parent_offset = offset;
          offset += width;
        }
      }
    });
  });
  return {tokens, parents, depths, scores};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("expand_depth", &expand_depth_cpu);
  m.impl("build_supertree", &build_supertree_cpu);
}

}  // namespace dartree
