// DecoderStack (decoder_layers.h): a Llama decoder stack on GGUF blocks as one C++ loop over the
// same op calls dartree_ext.flat_forward's direct plan makes from Python.
#include "decoder_layers.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <utility>

namespace dartree {
namespace {

using Opt = std::optional<at::Tensor>;

// The registered ops, found once (their CPU kernels are in this library).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, const Opt&)> quant,
      quant_int8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> norm;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&)>
      rotary;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, double)>
      attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> silu_mul;
};

const Ops& ops() {
  static const Ops found = [] {
    auto& d = c10::Dispatcher::singleton();
    using Quant = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, const Opt&);
    return Ops{
        d.findSchemaOrThrow("dartree_ext::quant_linear", "").typed<Quant>(),
        d.findSchemaOrThrow("dartree_ext::quant_linear_int8", "").typed<Quant>(),
        d.findSchemaOrThrow("dartree_ext::rms_norm_rows", "").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("dartree_ext::rotary_tables", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&)>(),
        d.findSchemaOrThrow("dartree_ext::few_rows_attention", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, double)>(),
        d.findSchemaOrThrow("dartree_ext::silu_mul", "").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(),
    };
  }();
  return found;
}

at::Tensor linear(const BlockLinear& l, const at::Tensor& h) {
  const Ops& o = ops();
  return (l.int8 ? o.quant_int8 : o.quant).call(h, l.blocks, l.kind, std::nullopt);
}

std::vector<at::Tensor> linear_parts(const BlockLinear& l, const at::Tensor& h) {
  at::Tensor y = linear(l, h);
  if (l.sizes.size() == 1) return {y};
  return y.split_with_sizes(l.sizes, -1);
}

// Whether `view` is the first `length` slots of `buffer` with room for `fresh` more, the layout the
// layer's keys or values of `width` features (H_kv * D) take.
bool prefix_with_room(const Opt& view, const Opt& buffer, const at::Tensor& x, int64_t length, int64_t fresh,
                      int64_t width, int64_t head_dim) {
  if (!view.has_value() || !buffer.has_value() || !view->defined() || !buffer->defined()) return false;
  const at::Tensor &v = *view, &b = *buffer;
  return v.dim() == 4 && b.dim() == 4 && b.device().is_cpu() && v.data_ptr() == b.data_ptr() &&
         v.strides() == b.strides() && v.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type() &&
         v.size(0) == x.size(0) && b.size(0) == x.size(0) && v.size(1) == b.size(1) && v.size(3) == b.size(3) &&
         b.size(3) == head_dim && b.size(1) * head_dim == width && v.size(2) == length &&
         length + fresh <= b.size(2);
}

}  // namespace

DecoderStack::DecoderStack(std::vector<DecoderLayer> layers, int64_t head_dim)
    : layers_(std::move(layers)), head_dim_(head_dim) {
  TORCH_CHECK_VALUE(head_dim > 0, "DecoderStack: head_dim must be positive, got ", head_dim);
  for (const DecoderLayer& l : layers_) {
    TORCH_CHECK_VALUE(l.qkv.sizes.size() == 3 && l.gate_up.sizes.size() == 2 && l.o.sizes.size() == 1 &&
                          l.down.sizes.size() == 1,
                      "DecoderStack: a layer needs q / k / v and gate / up joined, o and down alone");
    TORCH_CHECK_VALUE(l.gate_up.sizes[0] == l.gate_up.sizes[1], "DecoderStack: gate and up must have one size");
    for (const BlockLinear* g : {&l.qkv, &l.o, &l.gate_up, &l.down})
      TORCH_CHECK_VALUE(g->blocks.defined() && g->blocks.device().is_cpu(), "DecoderStack: CPU blocks expected");
    TORCH_CHECK_VALUE(l.norm_in.defined() && l.norm_post.defined(), "DecoderStack: norm weights expected");
  }
}

std::optional<std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>>
DecoderStack::run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                  int64_t first, const std::vector<Opt>& keys, const std::vector<Opt>& values,
                  const std::vector<Opt>& key_buffers, const std::vector<Opt>& value_buffers, bool all_states) const {
  const int64_t count = size() - first;
  TORCH_CHECK_VALUE(first >= 0 && first <= size(), "DecoderStack.run: first layer ", first, " of ", size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(keys.size()) == count && static_cast<int64_t>(values.size()) == count &&
                        static_cast<int64_t>(key_buffers.size()) == count &&
                        static_cast<int64_t>(value_buffers.size()) == count,
                    "DecoderStack.run: one cache entry a layer expected (", count, ")");
  TORCH_CHECK_VALUE(x_in.dim() == 3 && x_in.device().is_cpu(), "DecoderStack.run: x [B, T, hidden] on the CPU");
  if (count == 0) return std::nullopt;
  const int64_t rows = x_in.size(1);
  if (!keys[0].has_value() || !keys[0]->defined() || keys[0]->dim() != 4) return std::nullopt;
  const int64_t length = keys[0]->size(2);
  if (mask.dim() != 4 || mask.size(-1) != length + rows) return std::nullopt;
  for (int64_t i = 0; i < count; ++i) {
    const DecoderLayer& l = layers_[first + i];
    if (!prefix_with_room(keys[i], key_buffers[i], x_in, length, rows, l.qkv.sizes[1], head_dim_) ||
        !prefix_with_room(values[i], value_buffers[i], x_in, length, rows, l.qkv.sizes[2], head_dim_))
      return std::nullopt;
  }
  const Ops& o = ops();
  const std::vector<int64_t> hidden_shape{x_in.size(0), rows, -1, head_dim_};
  const std::vector<int64_t> flat_shape{x_in.size(0), rows, -1};
  std::vector<at::Tensor> states, key_views, value_views;
  states.reserve(all_states ? count : 1);
  key_views.reserve(count);
  value_views.reserve(count);
  at::Tensor x = x_in;
  for (int64_t i = 0; i < count; ++i) {
    const DecoderLayer& l = layers_[first + i];
    at::Tensor residual = x;
    std::vector<at::Tensor> qkv = linear_parts(l.qkv, o.norm.call(x, l.norm_in, l.eps_in));
    at::Tensor q = qkv[0].view(hidden_shape).transpose(1, 2), k = qkv[1].view(hidden_shape).transpose(1, 2),
               v = qkv[2].view(hidden_shape).transpose(1, 2);
    std::tie(q, k) = o.rotary.call(q, k, cos, sin);
    const at::Tensor &kbuf = *key_buffers[i], &vbuf = *value_buffers[i];
    kbuf.narrow(2, length, rows).copy_(k);
    vbuf.narrow(2, length, rows).copy_(v);
    at::Tensor kview = kbuf.narrow(2, 0, length + rows), vview = vbuf.narrow(2, 0, length + rows);
    at::Tensor out = o.attention.call(q, kview, vview, mask, l.scaling).transpose(1, 2).contiguous();
    x = at::add(residual, linear(l.o, out.reshape(flat_shape).contiguous()));
    residual = x;
    std::vector<at::Tensor> gate_up = linear_parts(l.gate_up, o.norm.call(x, l.norm_post, l.eps_post));
    x = at::add(residual, linear(l.down, o.silu_mul.call(gate_up[0], gate_up[1])));
    if (all_states) states.push_back(x);
    key_views.push_back(std::move(kview));
    value_views.push_back(std::move(vview));
  }
  if (!all_states) states.push_back(x);
  return std::make_tuple(std::move(states), std::move(key_views), std::move(value_views));
}

}  // namespace dartree
