// Every op schema of the library, in one place, and the small pybind11 module `dartree_ext._C`.
// Implementations register per backend in csrc/cpu/<area>.cpp and csrc/cuda/<area>.cu.
#include <torch/library.h>

#include "kernels/launchers.h"

#ifdef DARTREE_PYTHON_MODULE
#include <Python.h>
#include <torch/extension.h>

#include "cpu/decoder_layers.h"
#endif

#ifndef DARTREE_TORCH_VERSION
#define DARTREE_TORCH_VERSION "unknown"
#endif
#ifndef DARTREE_CUDA_ARCHS
#define DARTREE_CUDA_ARCHS ""
#endif
#ifndef DARTREE_CUDA_VERSION
#define DARTREE_CUDA_VERSION ""
#endif

TORCH_LIBRARY(dartree_ext, m) {
  // tree_mask area
  m.def("tree_ancestor_bits(Tensor parents, Tensor num_nodes) -> (Tensor bits, Tensor depths)");
  m.def("tree_attention_mask(Tensor parents, Tensor num_nodes, Tensor past_key_mask, ScalarType dtype) -> Tensor");
  m.def("tree_links(Tensor parents, Tensor num_nodes) -> (Tensor next_token, Tensor next_sibling)");
  m.def("packed_tree_mask(Tensor bits, Tensor seq_lens, Tensor mask_indptr, int total_bytes) -> Tensor");
  // verify area
  m.def(
      "verify_tree(Tensor tokens, Tensor parents, Tensor num_nodes, Tensor target_tokens) -> "
      "(Tensor accept_nodes, Tensor accept_len, Tensor bonus)");
  // select area
  m.def(
      "select_top_w(Tensor parent_scores, Tensor child_logprobs, Tensor num_parents, int width) -> "
      "(Tensor parent_idx, Tensor child_k, Tensor scores)");
  m.def(
      "select_top_b(Tensor parents, Tensor scores, Tensor num_nodes, int budget) -> "
      "(Tensor keep, Tensor new_parents, Tensor num_kept)");
  m.def(
      "ddtree_heap(Tensor logprobs, Tensor token_ids, Tensor root_tokens, int budget) -> "
      "(Tensor tokens, Tensor parents, Tensor depths, Tensor scores, Tensor num_nodes)");
  // kv area
  m.def(
      "compact_kv_(Tensor(a!) keys, Tensor(b!) values, Tensor src_positions, Tensor dst_start, Tensor lengths) -> "
      "()");
  m.def("compact_kv_layers_(Tensor(a!)[] caches, Tensor src_positions, Tensor dst_start, Tensor lengths) -> ()");
  m.def(
      "compact_kv_paged_(Tensor(a!)[] caches, Tensor block_table, Tensor src_positions, Tensor dst_start, "
      "Tensor lengths) -> ()");
  // expand area
  m.def(
      "expand_depth(Tensor z, Tensor cand_ids, Tensor cand_base, Tensor parent_states, Tensor parent_scores, "
      "Tensor num_parents, Tensor w_s, Tensor fc2_weight, Tensor? fc2_bias, Tensor gru_table, Tensor w_hh, "
      "Tensor? b_hh, int width, float depth_bonus) -> "
      "(Tensor parent_idx, Tensor child_k, Tensor scores, Tensor tokens, Tensor states)");
  m.def(
      "build_supertree(Tensor z, Tensor cand_ids, Tensor cand_base, Tensor root_state, Tensor w_s, "
      "Tensor fc2_weight, Tensor? fc2_bias, Tensor gru_table, Tensor w_hh, Tensor? b_hh, int[] widths, "
      "float depth_bonus) -> (Tensor tokens, Tensor parents, Tensor depths, Tensor scores)");
  // vat area (training loss; dartree_ext/vat.py composes these)
  m.def(
      "vat_row_forward(Tensor draft_logits, Tensor target_logits, Tensor target_tokens, Tensor? uniforms, "
      "float temperature) -> (Tensor ce_soft, Tensor ce_hard, Tensor accept, Tensor draft_lse, Tensor target_lse)");
  m.def(
      "vat_row_backward(Tensor g_q, Tensor g_p, Tensor g_y, Tensor draft_logits, Tensor target_logits, "
      "Tensor target_tokens, Tensor draft_lse, Tensor target_lse) -> Tensor");
  m.def(
      "vat_block_weights(Tensor accept, Tensor valid, int schedule, float decay_gamma) -> "
      "(Tensor first_reject, Tensor weights)");
  // linear area (CPU only: a target's linear layers over the few rows of a verification forward)
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear_portable(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear_avx2(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear_avx512(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear_avx512_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // the same over weights kept in a GGUF's 4-/8-bit blocks (kind: q4_0, q4_1, q8_0)
  m.def("quant_linear(Tensor x, Tensor blocks, str kind, Tensor? bias) -> Tensor");
  m.def("quant_linear_portable(Tensor x, Tensor blocks, str kind, Tensor? bias) -> Tensor");
  // ... with x rounded to 8 bits a block of 32, integer dot products (CPU only)
  m.def("quant_linear_int8(Tensor x, Tensor blocks, str kind, Tensor? bias) -> Tensor");
  m.def("quant_linear_int8_portable(Tensor x, Tensor blocks, str kind, Tensor? bias) -> Tensor");
  // bfloat16 through AMX tiles over weights packed by pack_amx (CPU only; batch-invariant)
  m.def("amx_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  // attention area (CPU only: a verification forward's or a plain step's few query rows)
  m.def("few_rows_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  // drafter area (CPU only: a drafter pass's elementwise steps, one call each)
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_rows(Tensor x, Tensor positions, float theta) -> Tensor");
  m.def("rotary_tables(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_build(Tensor gate, Tensor up, str build) -> Tensor");  // tests: one build forced
  // sampling area (CPU only: the target's token at each verified node)
  m.def("tokens_from_logits(Tensor logits, Tensor? uniforms, float temperature) -> Tensor");
}

#ifdef DARTREE_PYTHON_MODULE
namespace dartree {
std::string few_rows_linear_path_name(const std::string& dtype);  // csrc/cpu/linear.cpp
std::string vector_build_name();                                   // csrc/cpu/rows.cpp
std::string quant_linear_path_name();                              // csrc/cpu/quant_linear.cpp
std::string quant_linear_int8_path_name();                         // csrc/cpu/quant_linear_int8.cpp
std::string amx_linear_path_name();                                // csrc/cpu/amx_linear.cpp
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = DARTREE_TORCH_VERSION;
#ifdef DARTREE_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_version"] = DARTREE_CUDA_VERSION;
  info["cuda_archs"] = DARTREE_CUDA_ARCHS;
  info["max_tree_nodes"] = dartree::kernels::kMaxNodes;
  info["max_heap_budget"] = dartree::kernels::kMaxHeapBudget;
  pybind11::dict linear;  // which few_rows_linear path runs on this CPU, per dtype
  linear["float32"] = dartree::few_rows_linear_path_name("float32");
  linear["bfloat16"] = dartree::few_rows_linear_path_name("bfloat16");
  info["few_rows_linear"] = linear;
  info["quant_linear"] = dartree::quant_linear_path_name();
  info["quant_linear_int8"] = dartree::quant_linear_int8_path_name();
  info["amx_linear"] = dartree::amx_linear_path_name();  // "amx_bf16" or "unavailable"
  info["vector_build"] = dartree::vector_build_name();  // the row ops' lanes: avx512, avx2 or base
  return info;
}

// Every tensor of `tensors` cut to its first `length` entries along `dim` (a view; a tensor no longer
// than that as it is), in one call: a decoder cropping the keys and values of every layer of a KV
// cache after a round (60 tensors for a 30-layer model, where Python's slicing costs a few
// microseconds a tensor).
std::vector<at::Tensor> narrow_all(const std::vector<at::Tensor>& tensors, int64_t dim, int64_t length) {
  TORCH_CHECK_VALUE(length >= 0, "narrow_all: length must be >= 0, got ", length);
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.size(dim) > length ? t.narrow(dim, 0, length) : t);
  return out;
}

// A DecoderStack from flat lists, two entries a layer for the norms (input, post-attention), four
// for the linear groups (q / k / v joined, o, gate / up joined, down).
dartree::DecoderStack make_decoder_stack(const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                                         const std::vector<at::Tensor>& blocks, const std::vector<std::string>& kinds,
                                         const std::vector<bool>& int8,
                                         const std::vector<std::vector<int64_t>>& sizes,
                                         const std::vector<double>& scalings, int64_t head_dim) {
  const size_t count = scalings.size();
  TORCH_CHECK_VALUE(norms.size() == 2 * count && eps.size() == 2 * count && blocks.size() == 4 * count &&
                        kinds.size() == 4 * count && int8.size() == 4 * count && sizes.size() == 4 * count,
                    "DecoderStack: 2 norms and 4 linear groups a layer expected for ", count, " layers");
  std::vector<dartree::DecoderLayer> layers(count);
  for (size_t i = 0; i < count; ++i) {
    dartree::DecoderLayer& l = layers[i];
    l.norm_in = norms[2 * i];
    l.norm_post = norms[2 * i + 1];
    l.eps_in = eps[2 * i];
    l.eps_post = eps[2 * i + 1];
    l.scaling = scalings[i];
    dartree::BlockLinear* groups[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (size_t g = 0; g < 4; ++g)
      *groups[g] = dartree::BlockLinear{blocks[4 * i + g], kinds[4 * i + g], int8[4 * i + g], sizes[4 * i + g]};
  }
  return dartree::DecoderStack(std::move(layers), head_dim);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dartree_ext native ops (registered under torch.ops.dartree_ext)";
  m.def("build_info", &build_info, "How this extension was built: torch version, CUDA kernels, archs.");
  m.def("narrow_all", &narrow_all, pybind11::arg("tensors"), pybind11::arg("dim"), pybind11::arg("length"),
        "Every tensor cut to its first `length` entries along `dim` (views), in one call.");
  pybind11::class_<dartree::DecoderStack>(m, "DecoderStack",
                                          "A Llama decoder stack on GGUF blocks run as one C++ loop (flat_forward)")
      .def(pybind11::init(&make_decoder_stack), pybind11::arg("norms"), pybind11::arg("eps"),
           pybind11::arg("blocks"), pybind11::arg("kinds"), pybind11::arg("int8"), pybind11::arg("sizes"),
           pybind11::arg("scalings"), pybind11::arg("head_dim"))
      .def("run", &dartree::DecoderStack::run, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("mask"), pybind11::arg("first"), pybind11::arg("keys"), pybind11::arg("values"),
           pybind11::arg("key_buffers"), pybind11::arg("value_buffers"), pybind11::arg("all_states"),
           "Layers [first, len) over x and the cache; None (nothing written) where a cache is not a buffer's "
           "prefix with room")
      .def("__len__", &dartree::DecoderStack::size);
}
#endif
