// Input checks of the tree_mask ops (tree_ancestor_bits and tree_links take check_tree alone).
#pragma once

#include "common.h"

namespace dartree {

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

}  // namespace dartree
