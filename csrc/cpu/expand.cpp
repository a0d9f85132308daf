// CPU kernels for DARTree's depth-wise expansion with a GRU correction head: expand_depth (one
// depth) and build_supertree (all depths in one call). Same math, order and padding as
// csrc/kernels/expand.cuh; accumulation in float32 whatever the weights' dtype. Unlike the GPU,
// where one block per parent / child does everything, the CPU runs one request at a time through
// plain loops the compiler vectorizes (no ATen or BLAS call inside: build_supertree runs right
// after the target's forward, when a library's code paths are cold and each call costs 10-100x
// its warm time on a small VM).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
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

// out[i * out_stride + j] = bias[j] (0 without) + dot(x[i * x_stride : + n], w[j * n : + n]) for
// i < rows_x, j < rows_w: four rows of x at a time against each row of w (four independent sums,
// so the vector FMAs do not wait on one another), float32 throughout.
DARTREE_VEC_INLINE void rows_dot_impl(const float* x, int64_t rows_x, int64_t x_stride, const float* w, int64_t rows_w,
                                      int64_t n, const float* bias, float* out, int64_t out_stride) {
  int64_t i = 0;
  for (; i + 4 <= rows_x; i += 4) {
    const float* x0 = x + i * x_stride;
    const float* x1 = x0 + x_stride;
    const float* x2 = x1 + x_stride;
    const float* x3 = x2 + x_stride;
    for (int64_t j = 0; j < rows_w; ++j) {
      const float* wj = w + j * n;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < n; ++k) {
        s0 += x0[k] * wj[k];
        s1 += x1[k] * wj[k];
        s2 += x2[k] * wj[k];
        s3 += x3[k] * wj[k];
      }
      const float b = bias != nullptr ? bias[j] : 0.0f;
      out[i * out_stride + j] = b + s0;
      out[(i + 1) * out_stride + j] = b + s1;
      out[(i + 2) * out_stride + j] = b + s2;
      out[(i + 3) * out_stride + j] = b + s3;
    }
  }
  for (; i < rows_x; ++i) {
    const float* xi = x + i * x_stride;
    for (int64_t j = 0; j < rows_w; ++j) {
      const float* wj = w + j * n;
      float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
      for (int64_t k = 0; k < n; ++k) s0 += xi[k] * wj[k];
      out[i * out_stride + j] = (bias != nullptr ? bias[j] : 0.0f) + s0;
    }
  }
}
DARTREE_AVX2_DISPATCH(void, rows_dot,
                      (const float* x, int64_t rows_x, int64_t x_stride, const float* w, int64_t rows_w, int64_t n,
                       const float* bias, float* out, int64_t out_stride),
                      (x, rows_x, x_stride, w, rows_w, n, bias, out, out_stride))

template <int N>
DARTREE_VEC_INLINE void silu_inplace_impl(float* v, int64_t n) {
  using L = Lanes<N>;
  L::binary(v, v, v, n, [](const float* x, const float*, float* y) { L::store(y, L::silu(L::load(x))); });
}
DARTREE_LANES_DISPATCH(void, silu_inplace, (float* v, int64_t n), (v, n))

// The head as the CPU expansion reads it: its small matrices (w_s, w_hh, b_hh) as float32, once
// per call, read for every parent; fc2 and gru_table stay as they are (only the K candidate rows
// and the chosen tokens' rows are ever read). No ATen call: the expansion runs right after the
// target's forward, when every library code path it would touch is cold.
template <typename T>
struct CpuHead {
  const float* w_s;   // [E, G]
  const float* w_hh;  // [3G, G]
  const float* b_hh;  // [3G], or null
  const T* fc2;       // [V, E]
  const T* fc2_bias;  // [V] or null
  const T* gru_table; // [V, 3G]
  int64_t e, g;

  // The float32 copies live in one buffer per thread, reused from call to call (a fresh 200 KiB
  // allocation each call would be mapped and faulted in by the kernel every round). One CpuHead
  // is alive at a time in a thread: each op call makes one.
  explicit CpuHead(const HeadWeights& w)
      : fc2(w.fc2_weight.data_ptr<T>()), fc2_bias(w.fc2_bias.has_value() ? w.fc2_bias->data_ptr<T>() : nullptr),
        gru_table(w.gru_table.data_ptr<T>()), e(w.w_s.size(0)), g(w.w_s.size(1)) {
    static thread_local std::vector<float> buffer;
    const int64_t n_s = w.w_s.numel(), n_hh = w.w_hh.numel(), n_b = w.b_hh.has_value() ? 3 * g : 0;
    if (static_cast<int64_t>(buffer.size()) < n_s + n_hh + n_b) buffer.resize(n_s + n_hh + n_b);
    float* out = buffer.data();
    widen(w.w_s.data_ptr<T>(), out, n_s);
    widen(w.w_hh.data_ptr<T>(), out + n_s, n_hh);
    if (n_b) widen(w.b_hh->data_ptr<T>(), out + n_s + n_hh, n_b);
    w_s = out;
    w_hh = out + n_s;
    b_hh = n_b ? out + n_s + n_hh : nullptr;
  }
};

// fn(T{}) for the head's weight type T: float, c10::BFloat16 or c10::Half (the checks allow no other).
template <typename Fn>
void with_head_type(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "the correction head's weights must be float32, bfloat16 or float16, got ", dtype);
  }
}

// One depth's inputs for request-major rows: z [B, E], cand_ids / cand_base [B, K] (row strides),
// the parents' float32 states [B, P, G] and scores (row stride), each request's parent count.
template <typename T>
struct DepthIn {
  const T* z;
  int64_t z_stride;
  const int64_t* ids;
  const T* base;
  int64_t cand_stride, k;
  const float* states;
  int64_t p_max;
  const float* parent_scores;
  int64_t parent_score_stride;
  const int32_t* num_parents;
};

struct DepthOut {
  int32_t* parent_idx;
  int32_t* child_k;  // or null
  float* scores;
  int64_t* tokens;
  int32_t* depths;  // or null
  int64_t stride;
  int parent_offset, depth_value;
};

// One depth for the whole batch, request by request: the parents' head hidden states, the
// candidates' corrected logits (log-softmax over the K candidates, fused into the selection),
// top-W of all parents' children, then the kept children's GRU states (only for parents that got
// a child), written to child_states [B, W, G] when it is non-null (the last depth's children are
// never expanded). Writes each request's child count.
template <typename T>
void expand_batch(const CpuHead<T>& head, const DepthIn<T>& in, int64_t batch, int64_t width, float depth_bonus,
                  const DepthOut& out, int32_t* num_children, float* child_states) {
  const int64_t k = in.k, e = head.e, g = head.g, p_max = in.p_max;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> zf(e), hidden(p_max * e), rows(k * e), base(k), logits(p_max * k), gates, table_row(3 * g);
    std::vector<Scored> candidates;
    std::vector<int32_t> chosen(width), gate_row(width), row_of(p_max);
    std::vector<int64_t> distinct;
    std::vector<float> distinct_states;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t parents_here = in.num_parents[b];
      const float* st = in.states + b * p_max * g;
      const int64_t* ids = in.ids + b * in.cand_stride;
      widen(in.z + b * in.z_stride, zf.data(), e);
      rows_dot(st, parents_here, g, head.w_s, e, g, zf.data(), hidden.data(), e);  // z + W_s s
      silu_inplace(hidden.data(), parents_here * e);
      widen(in.base + b * in.cand_stride, base.data(), k);
      for (int64_t c = 0; c < k; ++c) {
        widen(head.fc2 + ids[c] * e, rows.data() + c * e, e);
        if (head.fc2_bias != nullptr) base[c] += static_cast<float>(head.fc2_bias[ids[c]]);
      }
      rows_dot(hidden.data(), parents_here, e, rows.data(), k, e, base.data(), logits.data(), k);
      candidates.resize(parents_here * k);
      for (int64_t p = 0; p < parents_here; ++p) {
        const float* row = logits.data() + p * k;
        float max_logit = kNegInf;
        for (int64_t c = 0; c < k; ++c) max_logit = std::max(max_logit, row[c]);
        float sum = 0.0f;
        for (int64_t c = 0; c < k; ++c) sum += std::exp(row[c] - max_logit);
        const float offset =
            in.parent_scores[b * in.parent_score_stride + p] + depth_bonus - (max_logit + std::log(sum));
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
        chosen[i] = static_cast<int32_t>(p);
        out.parent_idx[row + i] = static_cast<int32_t>(p + out.parent_offset);
        if (out.child_k) out.child_k[row + i] = static_cast<int32_t>(c);
        out.scores[row + i] = candidates[i].score;
        out.tokens[row + i] = ids[c];
        if (out.depths) out.depths[row + i] = out.depth_value;
      }
      if (child_states == nullptr) continue;
      // the hidden gates W_hh s + b_hh, once per parent that got a child
      distinct.clear();
      std::fill(row_of.begin(), row_of.end(), -1);
      for (int64_t i = 0; i < take; ++i) {
        const int32_t p = chosen[i];
        if (row_of[p] < 0) {
          row_of[p] = static_cast<int32_t>(distinct.size());
          distinct.push_back(p);
        }
        gate_row[i] = row_of[p];
      }
      distinct_states.resize(distinct.size() * g);
      for (size_t r = 0; r < distinct.size(); ++r)
        std::memcpy(distinct_states.data() + r * g, st + distinct[r] * g, g * sizeof(float));
      gates.resize(distinct.size() * 3 * g);
      rows_dot(distinct_states.data(), static_cast<int64_t>(distinct.size()), g, head.w_hh, 3 * g, g, head.b_hh,
               gates.data(), 3 * g);
      float* cs = child_states + b * width * g;
      for (int64_t i = 0; i < width; ++i) {
        float* state_out = cs + i * g;
        if (i >= take) {
          std::fill(state_out, state_out + g, 0.0f);
          continue;
        }
        widen(head.gru_table + out.tokens[row + i] * 3 * g, table_row.data(), 3 * g);
        gru_cell(table_row.data(), gates.data() + gate_row[i] * 3 * g, st + chosen[i] * g, state_out, g);
      }
    }
  });
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
  const int64_t batch = z.size(0), p_max = parent_states.size(1), g = w_s.size(1);
  const int32_t* counts = num_parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(counts[b] >= 0 && counts[b] <= p_max, "expand_depth: num_parents[", b, "] = ", counts[b],
                      " is outside [0, ", p_max, "]");
  at::Tensor parent_idx = at::empty({batch, width}, num_parents.options());
  at::Tensor child_k = at::empty({batch, width}, num_parents.options());
  at::Tensor scores = at::empty({batch, width}, parent_scores.options());
  at::Tensor tokens = at::empty({batch, width}, cand_ids.options());
  at::Tensor states = at::empty({batch, width, g}, parent_states.options());
  std::vector<int32_t> num_children(batch);
  const DepthOut out{parent_idx.data_ptr<int32_t>(), child_k.data_ptr<int32_t>(), scores.data_ptr<float>(),
                     tokens.data_ptr<int64_t>(), nullptr, width, 0, 0};
  const at::Tensor z_c = z.contiguous(), ids_c = cand_ids.contiguous(), base_c = cand_base.contiguous();
  const at::Tensor states_c = parent_states.contiguous(), scores_c = parent_scores.contiguous();
  with_head_type(w_s.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const CpuHead<scalar_t> head(weights);
    const DepthIn<scalar_t> in{z_c.data_ptr<scalar_t>(), head.e, ids_c.data_ptr<int64_t>(), base_c.data_ptr<scalar_t>(),
                               ids_c.size(1), ids_c.size(1), states_c.data_ptr<float>(), p_max,
                               scores_c.data_ptr<float>(), p_max, counts};
    expand_batch(head, in, batch, width, static_cast<float>(depth_bonus), out, num_children.data(),
                 states.data_ptr<float>());
  });
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
  const int64_t batch = z.size(0), depth = z.size(1), k = cand_ids.size(2), g = w_s.size(1);
  auto [tokens, parents, depths, scores, total] = allocate_supertree(cand_ids, widths);
  const at::Tensor z_c = z.contiguous(), ids_c = cand_ids.contiguous(), base_c = cand_base.contiguous();
  const at::Tensor root_c = root_state.contiguous();
  with_head_type(w_s.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const CpuHead<scalar_t> head(weights);
    // the parents' states of the depth being expanded, [B, P, G] (P = the previous depth's width)
    std::vector<float> states(batch * g), next;
    for (int64_t b = 0; b < batch; ++b) widen(root_c.data_ptr<scalar_t>() + b * g, states.data() + b * g, g);
    const std::vector<float> root_scores(batch, 0.0f);
    std::vector<int32_t> counts[2] = {std::vector<int32_t>(batch, 1), std::vector<int32_t>(batch)};
    int64_t offset = 0, parent_offset = -1, p_max = 1;
    for (int64_t d = 0; d < depth; ++d) {
      const DepthOut out{parents.data_ptr<int32_t>() + offset, nullptr, scores.data_ptr<float>() + offset,
                         tokens.data_ptr<int64_t>() + offset, depths.data_ptr<int32_t>() + offset, total,
                         static_cast<int>(parent_offset), static_cast<int>(d + 1)};
      const DepthIn<scalar_t> in{z_c.data_ptr<scalar_t>() + d * head.e, depth * head.e,
                                 ids_c.data_ptr<int64_t>() + d * k, base_c.data_ptr<scalar_t>() + d * k, depth * k, k,
                                 states.data(), p_max,
                                 d == 0 ? root_scores.data() : scores.data_ptr<float>() + parent_offset,
                                 d == 0 ? 1 : total, counts[d % 2].data()};
      const bool expand_next = d + 1 < depth;
      if (expand_next) next.assign(batch * widths[d] * g, 0.0f);
      expand_batch(head, in, batch, widths[d], static_cast<float>(depth_bonus), out, counts[1 - d % 2].data(),
                   expand_next ? next.data() : nullptr);
      states.swap(next);
      p_max = widths[d];
      parent_offset = offset;
      offset += widths[d];
    }
  });
  return {tokens, parents, depths, scores};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("expand_depth", &expand_depth_cpu);
  m.impl("build_supertree", &build_supertree_cpu);
}

}  // namespace dartree
