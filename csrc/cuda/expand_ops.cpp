// CUDA ops for DARTree's depth-wise expansion: checks, device guard, outputs and workspaces,
// current stream. Plain C++ (no nvcc): the kernels are compiled from csrc/kernels/expand.cuh by
// csrc/cuda/expand.cu, so torch's headers are parsed once per build rather than once per GPU arch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks/expand.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

kernels::HeadWeightPtrs head_weight_ptrs(const HeadWeights& w) {
  const at::ScalarType dtype = w.w_s.scalar_type();
  const kernels::ElemType elem = dtype == at::kBFloat16 ? kernels::ElemType::kBFloat16
                                 : dtype == at::kHalf   ? kernels::ElemType::kFloat16
                                                        : kernels::ElemType::kFloat32;
  return kernels::HeadWeightPtrs{elem,
                                 w.w_s.data_ptr(),
                                 w.fc2_weight.data_ptr(),
                                 w.fc2_bias.has_value() ? w.fc2_bias->data_ptr() : nullptr,
                                 w.gru_table.data_ptr(),
                                 w.w_hh.data_ptr(),
                                 w.b_hh.has_value() ? w.b_hh->data_ptr() : nullptr,
                                 static_cast<int>(w.w_s.size(0)),
                                 static_cast<int>(w.w_s.size(1)),
                                 w.fc2_weight.size(0)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_depth_cuda(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& parent_states,
    const at::Tensor& parent_scores, const at::Tensor& num_parents, const at::Tensor& w_s, const at::Tensor& fc2_weight,
    const std::optional<at::Tensor>& fc2_bias, const at::Tensor& gru_table, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_hh, int64_t width, double depth_bonus) {
  const HeadWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_expand_depth_inputs(weights, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width);
  const c10::cuda::CUDAGuard guard(z.device());
  const int64_t batch = z.size(0), p_max = parent_states.size(1), k = cand_ids.size(1), g = w_s.size(1);
  at::Tensor parent_idx = at::empty({batch, width}, num_parents.options());
  at::Tensor child_k = at::empty({batch, width}, num_parents.options());
  at::Tensor scores = at::empty({batch, width}, parent_scores.options());
  at::Tensor tokens = at::empty({batch, width}, cand_ids.options());
  at::Tensor states = at::empty({batch, width, g}, parent_states.options());
  const int64_t e = w_s.size(0);
  at::Tensor workspace = at::empty({kernels::expand_workspace_floats(batch, p_max, k, width, e, g)},
                                   parent_scores.options());
  at::Tensor num_children = at::empty({batch}, num_parents.options());               // workspace
  const kernels::ExpandInputs in{z.data_ptr(),
                                 z.size(1),
                                 cand_ids.data_ptr<int64_t>(),
                                 cand_base.data_ptr(),
                                 k,
                                 parent_states.data_ptr<float>(),
                                 parent_scores.data_ptr<float>(),
                                 p_max,
                                 num_parents.data_ptr<int32_t>(),
                                 static_cast<int>(batch),
                                 static_cast<int>(p_max),
                                 static_cast<int>(k),
                                 static_cast<int>(width),
                                 static_cast<float>(depth_bonus)};
  const kernels::ExpandOutputs out{parent_idx.data_ptr<int32_t>(), child_k.data_ptr<int32_t>(), scores.data_ptr<float>(),
                                   tokens.data_ptr<int64_t>(),     nullptr,                     width,
                                   0,                              0,                           states.data_ptr<float>(),
                                   num_children.data_ptr<int32_t>()};
  kernels::launch_expand_depth(head_weight_ptrs(weights), in, workspace.data_ptr<float>(), out,
                               at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {parent_idx, child_k, scores, tokens, states};
}

// All depths on the stream, no host synchronization: each depth's parent count is written by the
// previous depth's kernel, so the whole call can be captured in a CUDA graph.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_supertree_cuda(
    const at::Tensor& z, const at::Tensor& cand_ids, const at::Tensor& cand_base, const at::Tensor& root_state,
    const at::Tensor& w_s, const at::Tensor& fc2_weight, const std::optional<at::Tensor>& fc2_bias,
    const at::Tensor& gru_table, const at::Tensor& w_hh, const std::optional<at::Tensor>& b_hh, at::IntArrayRef widths,
    double depth_bonus) {
  const HeadWeights weights{w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh};
  check_build_supertree_inputs(weights, z, cand_ids, cand_base, root_state, widths);
  const c10::cuda::CUDAGuard guard(z.device());
  const int64_t batch = z.size(0), depth = z.size(1), k = cand_ids.size(2), g = w_s.size(1);
  auto [tokens, parents, depths, scores, total] = allocate_supertree(cand_ids, widths);
  int64_t max_width = 1;  // workspaces need at least one row, even for zero depths
  for (int64_t w : widths) max_width = std::max(max_width, w);
  const auto f32 = z.options().dtype(at::kFloat), i32 = z.options().dtype(at::kInt);
  // workspaces, sized from the shapes
  at::Tensor workspace =
      at::empty({kernels::expand_workspace_floats(batch, max_width, k, max_width, w_s.size(0), g)}, f32);
  at::Tensor states[2] = {at::empty({batch, max_width, g}, f32), at::empty({batch, max_width, g}, f32)};
  at::Tensor counts[2] = {at::ones({batch}, i32), at::empty({batch}, i32)};
  states[0].view(-1).narrow(0, 0, batch * g).view({batch, g}).copy_(root_state);  // dense [B, 1, G]
  const at::Tensor root_scores = at::zeros({batch}, f32);
  const kernels::SupertreeArgs args{z.data_ptr(),
                                    cand_ids.data_ptr<int64_t>(),
                                    cand_base.data_ptr(),
                                    widths.data(),
                                    static_cast<int>(batch),
                                    static_cast<int>(depth),
                                    static_cast<int>(k),
                                    static_cast<float>(depth_bonus),
                                    workspace.data_ptr<float>(),
                                    {states[0].data_ptr<float>(), states[1].data_ptr<float>()},
                                    root_scores.data_ptr<float>(),
                                    {counts[0].data_ptr<int32_t>(), counts[1].data_ptr<int32_t>()},
                                    tokens.data_ptr<int64_t>(),
                                    parents.data_ptr<int32_t>(),
                                    depths.data_ptr<int32_t>(),
                                    scores.data_ptr<float>()};
  kernels::launch_build_supertree(head_weight_ptrs(weights), args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, parents, depths, scores};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) {
  m.impl("expand_depth", &expand_depth_cuda);
  m.impl("build_supertree", &build_supertree_cuda);
}

}  // namespace dartree
