// CPU kernel for the tree verification walk.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks/verify.h"

namespace dartree {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cpu(const at::Tensor& tokens, const at::Tensor& parents,
                                                               const at::Tensor& num_nodes,
                                                               const at::Tensor& target_tokens) {
  check_verify_inputs(tokens, parents, num_nodes, target_tokens);
  const int64_t batch = parents.size(0), n_max = parents.size(1);
  at::Tensor accept_nodes = at::full({batch, n_max}, -1, parents.options());
  at::Tensor accept_len = at::empty({batch}, parents.options());
  at::Tensor bonus = at::empty({batch}, tokens.options());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes.data_ptr<int32_t>();
  const int64_t* target = target_tokens.data_ptr<int64_t>();
  int32_t* path = accept_nodes.data_ptr<int32_t>();
  int32_t* lengths = accept_len.data_ptr<int32_t>();
  int64_t* bonus_out = bonus.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> first_child(n_max), next_sibling(n_max);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = b * n_max, n = counts[b];
      std::fill(first_child.begin(), first_child.begin() + n, -1);
      for (int64_t i = n - 1; i >= 1; --i) {  // lists in index order: lowest index wins ties
        const int32_t p = par[base + i];
        next_sibling[i] = first_child[p];
        first_child[p] = static_cast<int32_t>(i);
      }
      int32_t current = 0, length = 0;
      path[base] = 0;
      for (;;) {
        const int64_t wanted = target[base + current];
        int32_t child = first_child[current];
        while (child >= 0 && tok[base + child] != wanted) child = next_sibling[child];
        if (child < 0) break;
        path[base + ++length] = child;
        current = child;
      }
      lengths[b] = length;
      bonus_out[b] = target[base + current];
    }
  });
  return {accept_nodes, accept_len, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) { m.impl("verify_tree", &verify_tree_cpu); }

}  // namespace dartree
