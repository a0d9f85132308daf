// Input checks of the expand ops (expand_depth, build_supertree), the bundle of the correction
// head's weights they take, and build_supertree's output allocation, shared by both backends.
#pragma once

#include <cstdint>
#include <optional>

#include "common.h"

namespace dartree {

// The correction head's weights as torch tensors (Python's CorrectionHeadWeights), as the expand
// ops take them; kernels::HeadWeightPtrs (kernels/launchers.h) is the plain-pointer form.
struct HeadWeights {
  const at::Tensor& w_s;         // [E, G]
  const at::Tensor& fc2_weight;  // [V, E]
  const std::optional<at::Tensor>& fc2_bias;  // [V]
  const at::Tensor& gru_table;   // [V, 3G]
  const at::Tensor& w_hh;        // [3G, G]
  const std::optional<at::Tensor>& b_hh;      // [3G]
};

inline void check_expand_weights(const char* op, const HeadWeights& w, const at::Tensor& device_of) {
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

// The CUDA selection kernel keeps its per-warp top-W lists in the 48 KiB of shared memory a block
// gets without opting in: 18 W floats, so W <= 682.
inline void check_expand_cuda_shared(const char* op, int64_t width) {
  TORCH_CHECK_VALUE(kernels::expand_select_shared_floats(width) <= kernels::kExpandSharedLimitFloats, op,
                    ": on CUDA a depth's width W must be at most 682 (18 W floats of shared memory), got W = ", width);
}

inline void check_expand_depth_inputs(const HeadWeights& w, const at::Tensor& z, const at::Tensor& cand_ids,
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
  TORCH_CHECK_VALUE(width >= 0 && width <= kMaxTreeNodes, op, ": width must be in [0, ", kMaxTreeNodes,
                    "] (a tree holds at most ", kMaxTreeNodes, " nodes), got ", width);
  check_expand_sizes(op, e, g, cand_ids.size(1));
  TORCH_CHECK_VALUE(parent_states.size(1) * cand_ids.size(1) < (int64_t{1} << 31), op, ": P * K must be below 2^31");
  TORCH_CHECK_VALUE(!z.is_cuda() || (batch <= 65535 && parent_states.size(1) <= 65535 && width <= 65535), op,
                    ": CUDA kernels take at most 65535 requests, parents and children per call");
  if (z.is_cuda()) check_expand_cuda_shared(op, width);
}

inline void check_build_supertree_inputs(const HeadWeights& w, const at::Tensor& z, const at::Tensor& cand_ids,
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
  int64_t total = 0;
  for (int64_t width : widths) {
    TORCH_CHECK_VALUE(width >= 1 && width <= 65535, op, ": every width must be in [1, 65535], got ", width);
    TORCH_CHECK_VALUE(width * cand_ids.size(2) < (int64_t{1} << 31), op, ": width * K must be below 2^31");
    total += width;
  }
  TORCH_CHECK_VALUE(total <= (int64_t{1} << 20), op, ": the widths add up to ", total,
                    " nodes a request; at most 2^20 (1048576)");
  check_expand_sizes(op, e, g, cand_ids.size(2));
  TORCH_CHECK_VALUE(!z.is_cuda() || batch <= 65535, op, ": CUDA kernels take at most 65535 requests per call");
  if (z.is_cuda()) {
    int64_t widest = 1;
    for (int64_t width : widths) widest = width > widest ? width : widest;
    check_expand_cuda_shared(op, widest);
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

}  // namespace dartree
