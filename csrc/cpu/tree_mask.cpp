// CPU kernels for the tree-structure ops: ancestor bits, the additive tree-attention mask and
// first-child / next-sibling links.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks/tree_mask.h"

namespace dartree {
namespace {

int64_t words_for(int64_t n) { return (n + 63) / 64; }

// Ancestor rows of one request: row i = row parent(i) with bit i added (parents come first in
// the layout, so one forward pass suffices). Padding rows hold only their own bit, depth -1.
void fill_ancestor_rows(const int32_t* parents, int64_t n, int64_t n_max, uint64_t* rows, int32_t* depths) {
  const int64_t words = words_for(n_max);
  for (int64_t i = 0; i < n_max; ++i) {
    uint64_t* row = rows + i * words;
    if (i > 0 && i < n) {
      const int32_t p = parents[i];
      std::memcpy(row, rows + p * words, sizeof(uint64_t) * words);
      depths[i] = depths[p] + 1;
    } else {
      std::memset(row, 0, sizeof(uint64_t) * words);
      depths[i] = i == 0 ? 0 : -1;
    }
    row[i >> 6] |= uint64_t{1} << (i & 63);
  }
}

std::tuple<at::Tensor, at::Tensor> tree_ancestor_bits_cpu(const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree("tree_ancestor_bits", parents, num_nodes);
  const int64_t batch = parents.size(0), n_max = parents.size(1), words = words_for(n_max);
  at::Tensor bits = at::empty({batch, n_max, words}, parents.options().dtype(at::kLong));
  at::Tensor depths = at::empty({batch, n_max}, parents.options());
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  auto* rows = reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>());
  int32_t* dep = depths.data_ptr<int32_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      fill_ancestor_rows(par + b * n_max, counts[b], n_max, rows + b * n_max * words, dep + b * n_max);
  });
  return {bits, depths};
}

template <typename Bits>
void fill_attention_mask(const int32_t* parents, const int32_t* counts, const bool* past_key_mask, int64_t batch,
                         int64_t n_max, int64_t past, Bits hidden, Bits* out) {
  const int64_t words = words_for(n_max);
  const int64_t columns = past + n_max;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> rows(n_max * words);
    std::vector<int32_t> depths(n_max);
    std::vector<Bits> past_visible(past);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = counts[b];
      fill_ancestor_rows(parents + b * n_max, n, n_max, rows.data(), depths.data());
      const bool* past_row = past_key_mask + b * past;
      for (int64_t c = 0; c < past; ++c) past_visible[c] = past_row[c] ? Bits(0) : hidden;
      for (int64_t i = 0; i < n_max; ++i) {
        Bits* out_row = out + (b * n_max + i) * columns;
        if (i < n) {
          std::copy(past_visible.begin(), past_visible.end(), out_row);
        } else {
          std::fill(out_row, out_row + past, hidden);  // padding sees only itself
        }
        const uint64_t* row = rows.data() + i * words;
        Bits* tree_part = out_row + past;
        for (int64_t j = 0; j < n_max; ++j) tree_part[j] = ((row[j >> 6] >> (j & 63)) & 1) ? Bits(0) : hidden;
      }
    }
  });
}

at::Tensor tree_attention_mask_cpu(const at::Tensor& parents, const at::Tensor& num_nodes,
                                   const at::Tensor& past_key_mask, at::ScalarType dtype) {
  check_attention_mask_inputs(parents, num_nodes, past_key_mask, dtype);
  const int64_t batch = parents.size(0), n_max = parents.size(1), past = past_key_mask.size(1);
  at::Tensor out = at::empty({batch, 1, n_max, past + n_max}, parents.options().dtype(dtype));
  const uint64_t hidden = lowest_value_bits(dtype);
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  const bool* pkm = past_key_mask.data_ptr<bool>();
  switch (at::elementSize(dtype)) {
    case 2:
      fill_attention_mask<uint16_t>(par, counts, pkm, batch, n_max, past, static_cast<uint16_t>(hidden),
                                    static_cast<uint16_t*>(out.data_ptr()));
      break;
    case 4:
      fill_attention_mask<uint32_t>(par, counts, pkm, batch, n_max, past, static_cast<uint32_t>(hidden),
                                    static_cast<uint32_t*>(out.data_ptr()));
      break;
    default:
      fill_attention_mask<uint64_t>(par, counts, pkm, batch, n_max, past, hidden, static_cast<uint64_t*>(out.data_ptr()));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> tree_links_cpu(const at::Tensor& parents, const at::Tensor& num_nodes) {
  check_tree("tree_links", parents, num_nodes);
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  at::Tensor next_token = at::full({batch, n_max}, -1, parents.options());
  at::Tensor next_sibling = at::full({batch, n_max}, -1, parents.options());
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  int32_t* first = next_token.data_ptr<int32_t>();
  int32_t* sibling = next_sibling.data_ptr<int32_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = b * n_max;
      // pushing children from the highest index down leaves every list in index order
      for (int64_t i = counts[b] - 1; i >= 1; --i) {
        const int32_t p = par[base + i];
        sibling[base + i] = first[base + p];
        first[base + p] = static_cast<int32_t>(i);
      }
    }
  });
  return {next_token, next_sibling};
}

}  // namespace

// FlashInfer's packed custom mask, request by request: bit f of the request's byte run is entry
// (f / L, f % L) of its [N, L = seq_len + N] mask, little-endian within each byte.
at::Tensor packed_tree_mask_cpu(const at::Tensor& bits, const at::Tensor& seq_lens, const at::Tensor& mask_indptr,
                                int64_t total_bytes) {
  check_packed_tree_mask_inputs(bits, seq_lens, mask_indptr, total_bytes);
  const int64_t batch = bits.size(0), n = bits.size(1), words = bits.size(2);
  at::Tensor out = at::zeros({total_bytes}, bits.options().dtype(at::kByte));
  const auto* rows = reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>());
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* indptr = mask_indptr.data_ptr<int32_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint8_t* bytes = dst + indptr[b];
      const int64_t s = lens[b], width = s + n;
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t* row = rows + (b * n + i) * words;
        for (int64_t c = 0; c < width; ++c) {
          const bool visible = c < s || ((row[(c - s) >> 6] >> ((c - s) & 63)) & 1u);
          const int64_t f = i * width + c;
          if (visible) bytes[f >> 3] |= static_cast<uint8_t>(1u << (f & 7));
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) {
  m.impl("packed_tree_mask", &packed_tree_mask_cpu);
  m.impl("tree_ancestor_bits", &tree_ancestor_bits_cpu);
  m.impl("tree_attention_mask", &tree_attention_mask_cpu);
  m.impl("tree_links", &tree_links_cpu);
}

}  // namespace dartree
