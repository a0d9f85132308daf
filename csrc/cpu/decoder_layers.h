// A Llama decoder stack on GGUF blocks run as one C++ loop: the calls dartree_ext.flat_forward's
// plan makes for a layer (rms_norm_rows, one block-op call for q / k / v, rotary_tables, the cache
// write, few_rows_attention, o_proj, the residual add, rms_norm_rows, one call for gate / up,
// silu_mul, down_proj, the residual add), in its order on the same tensors, so the outputs are the
// same bits; the ops go through the dispatcher from C++ instead of one Python call each (about 20
// a layer, a few microseconds each on a small CPU).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// The Python module builds with hidden symbols, as pybind11 classes must be.
#if defined(DARTREE_PYTHON_MODULE) && defined(__GNUC__)
#define DARTREE_STACK_VISIBILITY __attribute__((visibility("hidden")))
#else
#define DARTREE_STACK_VISIBILITY
#endif

namespace dartree {

// One linear group of a layer: its GGUF blocks (sibling layers joined as consecutive rows), their
// kind ("q4_0" / "q4_1" / "q8_0"), whether it runs quant_linear_int8, and the output sizes the
// joined result splits into (one entry where the group is one layer).
struct BlockLinear {
  at::Tensor blocks;
  std::string kind;
  bool int8 = false;
  std::vector<int64_t> sizes;
};

struct DecoderLayer {
  at::Tensor norm_in, norm_post;  // RMSNorm weights
  double eps_in = 0, eps_post = 0;
  BlockLinear qkv, o, gate_up, down;
  double scaling = 1;  // attention's softmax scale
};

class DARTREE_STACK_VISIBILITY DecoderStack {
 public:
  DecoderStack(std::vector<DecoderLayer> layers, int64_t head_dim);

  // Runs layers [first, size()) on x ([B, T, hidden]), rotary tables cos / sin ([B or 1, T, D]),
  // the additive mask over the length + T keys ([B or 1, 1, T, length + T]). The cache of layer
  // first + i is keys[i] / values[i] ([B, H_kv, length, D], the first `length` slots of
  // key_buffers[i] / value_buffers[i]); the new keys and values are written to the slots after
  // them. Returns nothing (and writes nothing) unless every layer's cache is such a prefix with
  // room for T more slots; else (the layers' outputs, or the last one only where !all_states; the
  // keys and the values, length + T slots, as views of the buffers).
  std::optional<std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>> run(
      const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask, int64_t first,
      const std::vector<std::optional<at::Tensor>>& keys, const std::vector<std::optional<at::Tensor>>& values,
      const std::vector<std::optional<at::Tensor>>& key_buffers,
      const std::vector<std::optional<at::Tensor>>& value_buffers, bool all_states) const;

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<DecoderLayer> layers_;
  int64_t head_dim_;
};

}  // namespace dartree
