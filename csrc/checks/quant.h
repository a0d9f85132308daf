// Input checks of quant_linear, shared by the CPU and CUDA entry points.
#pragma once

#include <c10/util/Half.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common.h"

namespace dartree {

constexpr int64_t kQuantMaxRows = 256;  // more rows than this: de-quantize and use a GEMM
constexpr int64_t kQuantBlock = 32;     // weights per block, every kind

// 0 = q4_0, 1 = q4_1, 2 = q8_0 (kernels::QuantKind)
inline int quant_kind(const char* op, const std::string& name) {
  if (name == "q4_0") return 0;
  if (name == "q4_1") return 1;
  if (name == "q8_0") return 2;
  TORCH_CHECK_VALUE(false, op, ": kind must be q4_0, q4_1 or q8_0, got '", name, "'");
}

constexpr int64_t quant_block_bytes_of(int kind) { return kind == 0 ? 18 : kind == 1 ? 20 : 34; }

// A block's little-endian fp16 field (d or m) as float32 (exact).
inline float quant_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct QuantShape {
  int kind;
  int64_t rows, in, out, row_bytes;
};

// `op`: the op's name in messages (quant_linear, quant_linear_int8).
inline QuantShape check_quant_inputs(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                                     const std::string& kind_name, const std::optional<at::Tensor>& bias) {
  const int kind = quant_kind(op, kind_name);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension");
  TORCH_CHECK(blocks.scalar_type() == at::kByte, op, ": blocks must be uint8 (the GGUF's bytes), got ",
              blocks.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous(), op,
              ": blocks must be a contiguous [out, bytes per row] matrix, got ", blocks.sizes(),
              blocks.is_contiguous() ? "" : " (not contiguous)");
  check_same_device(op, "blocks", blocks, x, "x");
  const int64_t bytes = quant_block_bytes_of(kind), row_bytes = blocks.size(1), out = blocks.size(0);
  TORCH_CHECK_VALUE(row_bytes % bytes == 0, op, ": a ", kind_name, " row is a whole number of ", bytes,
                    "-byte blocks, got ", row_bytes, " bytes per row");
  const int64_t in = row_bytes / bytes * kQuantBlock;
  TORCH_CHECK_VALUE(x.size(-1) == in, op, ": x has ", x.size(-1), " features but blocks hold ", in,
                    " per row (", row_bytes / bytes, " ", kind_name, " blocks of 32)");
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  TORCH_CHECK_VALUE(rows <= kQuantMaxRows, op, ": x has ", rows, " rows, at most ", kQuantMaxRows,
                    " (de-quantize and use a GEMM)");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias must be ", x.scalar_type(), " like x, got ",
                bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, op, ": bias must have shape [", out, "], got ",
                bias->sizes());
    check_same_device(op, "bias", *bias, x, "x");
  }
  return {kind, rows, in, out, row_bytes};
}

// What every quant op entry stages after its checks: the output shape (x's, last dim out), and,
// when there is work, x as float32 [rows, in] (exact for bfloat16) and the bias as float32.
struct QuantStaging {
  std::vector<int64_t> out_shape;
  at::Tensor x32, bias32;  // undefined when there is no work (rows or out 0) / no bias
  bool empty() const { return !x32.defined(); }
  const float* bias_ptr() const { return bias32.defined() ? bias32.data_ptr<float>() : nullptr; }
};

inline QuantStaging stage_quant_inputs(const at::Tensor& x, const QuantShape& s, const std::optional<at::Tensor>& bias) {
  QuantStaging staged;
  staged.out_shape.assign(x.sizes().begin(), x.sizes().end());
  staged.out_shape.back() = s.out;
  if (s.rows == 0 || s.out == 0) return staged;
  staged.x32 = x.reshape({s.rows, s.in}).to(at::kFloat).contiguous();
  if (bias.has_value() && bias->defined()) staged.bias32 = bias->to(at::kFloat).contiguous();
  return staged;
}

}  // namespace dartree
