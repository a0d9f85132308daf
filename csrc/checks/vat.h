// Input validation of the VAT-loss ops, shared by the CPU and CUDA implementations (kept apart
// from the other areas' checks so that VAT changes rebuild only the VAT files).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "../kernels/vat_launchers.h"
#include "common.h"

namespace dartree {

inline kernels::ElemType vat_elem(const char* op, const char* name, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kernels::ElemType::kFloat32;
    case at::kBFloat16: return kernels::ElemType::kBFloat16;
    case at::kHalf: return kernels::ElemType::kFloat16;
    case at::kDouble: return kernels::ElemType::kFloat64;
    default: TORCH_CHECK(false, op, ": ", name, " must be float32, bfloat16, float16 or float64, got ", dtype);
  }
  return kernels::ElemType::kFloat32;
}

// float64 statistics for float64 logits, float32 otherwise.
inline at::ScalarType vat_stat_dtype(at::ScalarType logits) { return logits == at::kDouble ? at::kDouble : at::kFloat; }

// draft_logits / target_logits [R, V] (same dtype), target_tokens int64 [R], uniforms float32 [R, 2].
inline void check_vat_rows(const char* op, const at::Tensor& draft, const at::Tensor& target,
                           const at::Tensor& tokens) {
  vat_elem(op, "draft_logits", draft.scalar_type());
  check_tensor(op, "draft_logits", draft, draft.scalar_type(), 2);
  check_tensor(op, "target_logits", target, draft.scalar_type(), 2);
  TORCH_CHECK(target.size(1) == draft.size(1), op, ": target_logits must have the draft's vocabulary size ",
              draft.size(1), " (last dim), got ", target.size(1));
  check_shape(op, "target_logits", target, draft.sizes());
  check_tensor(op, "target_tokens", tokens, at::kLong, 1);
  check_shape(op, "target_tokens", tokens, {draft.size(0)});
  check_same_device(op, "target_logits", target, draft, "draft_logits");
  check_same_device(op, "target_tokens", tokens, draft, "draft_logits");
  TORCH_CHECK_VALUE(draft.size(1) >= 1 && draft.size(1) < (int64_t{1} << 31), op,
                    ": the vocabulary size must be in [1, 2^31), got ", draft.size(1));
  TORCH_CHECK_VALUE(draft.size(0) < (int64_t{1} << 31), op, ": at most 2^31 - 1 rows, got ", draft.size(0));
}

inline void check_vat_row_forward_inputs(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,
                                         const std::optional<at::Tensor>& uniforms, double temperature) {
  const char* op = "vat_row_forward";
  check_vat_rows(op, draft, target, tokens);
  if (uniforms.has_value()) {
    check_tensor(op, "uniforms", *uniforms, at::kFloat, 2);
    check_shape(op, "uniforms", *uniforms, {draft.size(0), 2});
    check_same_device(op, "uniforms", *uniforms, draft, "draft_logits");
    TORCH_CHECK_VALUE(temperature > 0.0 && std::isfinite(temperature), op,
                      ": temperature must be finite and > 0 for the sampling rule, got ", temperature);
  }
}

inline void check_vat_row_backward_inputs(const at::Tensor& g_q, const at::Tensor& g_p, const at::Tensor& g_y,
                                          const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,
                                          const at::Tensor& draft_lse, const at::Tensor& target_lse) {
  const char* op = "vat_row_backward";
  check_vat_rows(op, draft, target, tokens);
  const at::ScalarType stat = vat_stat_dtype(draft.scalar_type());
  const int64_t rows = draft.size(0);
  const std::pair<const char*, const at::Tensor*> stats[] = {
      {"g_q", &g_q}, {"g_p", &g_p}, {"g_y", &g_y}, {"draft_lse", &draft_lse}, {"target_lse", &target_lse}};
  for (const auto& [name, t] : stats) {
    check_tensor(op, name, *t, stat, 1);
    check_shape(op, name, *t, {rows});
    check_same_device(op, name, *t, draft, "draft_logits");
  }
}

inline void check_vat_block_weights_inputs(const at::Tensor& accept, const at::Tensor& valid, int64_t schedule,
                                           double decay_gamma) {
  const char* op = "vat_block_weights";
  check_tensor(op, "accept", accept, at::kFloat, 2);
  check_tensor(op, "valid", valid, at::kBool, 2);
  check_shape(op, "valid", valid, accept.sizes());
  check_same_device(op, "valid", valid, accept, "accept");
  TORCH_CHECK_VALUE(schedule >= 0 && schedule <= 4, op, ": schedule must be 0..4 (vat, dflash, prefix_only, ",
                    "hard_cutoff, unshifted), got ", schedule);
  TORCH_CHECK_VALUE(decay_gamma > 0.0 && std::isfinite(decay_gamma), op, ": decay_gamma must be finite and > 0, got ",
                    decay_gamma);
  TORCH_CHECK_VALUE(accept.size(1) < (int64_t{1} << 30), op, ": block size K too large: ", accept.size(1));
}

}  // namespace dartree
