// Host entry points of the VAT-loss device code (csrc/kernels/vat.cuh), with the same rules as
// launchers.h: plain pointers and a stream, asynchronous, no synchronization, no allocation. Kept
// out of launchers.h (which every op's .cpp includes through csrc/checks/common.h) so that a
// change to the VAT launchers rebuilds only the VAT files.
#pragma once

#include <cstddef>
#include <cstdint>

#include "elem_type.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // the CUDA runtime's own definition

namespace dartree {
namespace kernels {

// Loss-weight schedules, in the order of dartree_ext.vat.SCHEDULES.
enum class VatSchedule : int { kVat = 0, kDflash = 1, kPrefixOnly = 2, kHardCutoff = 3, kUnshifted = 4 };

// One row r of `rows` (one draft position): logits draft[r, :V], target[r, :V] of `dtype`, target
// token tokens[r]. Writes, in the Acc type: ce_soft[r] = -sum_i p_i log q_i, ce_hard[r] = -log q_y
// (NaN when y is outside [0, V)), draft_lse[r] and target_lse[r] (logsumexp at temperature 1;
// q = softmax(draft), p = softmax(target)); and accept[r] (float 0/1): with uniforms == null the
// greedy rule (argmax draft == argmax target, ties to the lowest index), otherwise the sampling
// rule at `temperature`: x = the first index whose inclusive CDF of softmax(draft / T) exceeds
// uniforms[r, 0] (argmax draft if rounding leaves none), accepted iff
// uniforms[r, 1] * q_T(x) < p_T(x).
void launch_vat_row_forward(ElemType dtype, const void* draft, const void* target, const int64_t* tokens,
                            const float* uniforms, int64_t rows, int64_t vocab, double temperature, void* ce_soft,
                            void* ce_hard, void* draft_lse, void* target_lse, float* accept, cudaStream_t stream);

// grad_draft[r, i] = g_q[r] q_i - g_p[r] p_i - g_y[r] [i == y_r], in `dtype` (g_*, the LSEs in the
// Acc type). Rows whose three coefficients are all zero get exact zeros without reading the logits;
// the target row is read only where g_p[r] != 0.
void launch_vat_row_backward(ElemType dtype, const void* draft, const void* target, const int64_t* tokens,
                             const void* draft_lse, const void* target_lse, const void* g_q, const void* g_p,
                             const void* g_y, int64_t rows, int64_t vocab, void* grad_draft, cudaStream_t stream);

// Per block m of `blocks` (K positions each): first_reject[m] = the 1-based position of the first
// valid position with accept == 0 (K + 1 if none), and weights[m, k] from `schedule` (0 where
// valid is false). accept float [blocks, K], valid bool [blocks, K].
void launch_vat_block_weights(const float* accept, const uint8_t* valid, int64_t blocks, int k, int schedule,
                              double decay_gamma, int32_t* first_reject, float* weights, cudaStream_t stream);

}  // namespace kernels
}  // namespace dartree
