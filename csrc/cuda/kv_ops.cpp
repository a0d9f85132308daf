// CUDA op for KV-cache compaction: checks, device guard, current stream. Plain C++ (no nvcc): the
// kernel is compiled from csrc/kernels/kv.cuh by csrc/cuda/kv.cu.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks/kv.h"
#include "../kernels/launchers.h"

namespace dartree {
namespace {

// Every tensor in one launch per kMaxKvLayerCaches tensors. Values are not checked here (that would
// need a host synchronisation); the kernel skips positions outside the cache.
void compact_caches_cuda(at::TensorList caches, const at::Tensor& src_positions, const at::Tensor& dst_start,
                         const at::Tensor& lengths) {
  const c10::cuda::CUDAGuard guard(src_positions.device());
  const int unit = layer_unit_bytes(caches);
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < caches.size(); first += kernels::kMaxKvLayerCaches) {
    kernels::LayerKvCaches group{};
    for (size_t c = first; c < caches.size() && group.count < kernels::kMaxKvLayerCaches; ++c) {
      group.base[group.count] = caches[c].data_ptr();
      group.row_units[group.count] = caches[c].size(3) * caches[c].element_size() / unit;
      group.heads[group.count] = static_cast<int>(caches[c].size(1));
      ++group.count;
    }
    kernels::launch_compact_kv_layers(group, unit, static_cast<int>(src_positions.size(0)), caches[0].size(2),
                                      src_positions.data_ptr<int64_t>(), dst_start.data_ptr<int64_t>(),
                                      lengths.data_ptr<int32_t>(), static_cast<int>(src_positions.size(1)), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void compact_kv_cuda(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& src_positions,
                     const at::Tensor& dst_start, const at::Tensor& lengths) {
  check_compact_kv_moves(keys, values, src_positions, dst_start, lengths);
  check_kv_layer_caches("compact_kv_", {keys, values}, src_positions, {"keys", "values"});
  compact_caches_cuda({keys, values}, src_positions, dst_start, lengths);
}

void compact_kv_layers_cuda(at::TensorList caches, const at::Tensor& src_positions, const at::Tensor& dst_start,
                            const at::Tensor& lengths) {
  check_kv_moves("compact_kv_layers_", src_positions, dst_start, lengths);
  check_kv_layer_caches("compact_kv_layers_", caches, src_positions);
  compact_caches_cuda(caches, src_positions, dst_start, lengths);
}

// Every pool in one launch per kMaxPagedCaches pools. Values are not checked here (that would
// need a host synchronisation): the Python wrapper's validate=True checks them on a host copy.
void compact_kv_paged_cuda(at::TensorList caches, const at::Tensor& block_table, const at::Tensor& src_positions,
                           const at::Tensor& dst_start, const at::Tensor& lengths) {
  check_compact_kv_paged_inputs(caches, block_table, src_positions, dst_start, lengths);
  const c10::cuda::CUDAGuard guard(block_table.device());
  const int unit = paged_unit_bytes(caches);
  const int64_t num_pages = caches[0].size(0), page_size = caches[0].size(1);
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < caches.size(); first += kernels::kMaxPagedCaches) {
    kernels::PagedKvCaches pools{};
    pools.num_pages = num_pages;
    for (size_t c = first; c < caches.size() && pools.count < kernels::kMaxPagedCaches; ++c) {
      const at::Tensor& pool = caches[c];
      const int64_t slots = num_pages * page_size;
      pools.base[pools.count] = pool.data_ptr();
      pools.row_units[pools.count] = slots ? pool.numel() / slots * pool.element_size() / unit : 0;
      ++pools.count;
    }
    kernels::launch_compact_kv_paged(pools, unit, static_cast<int>(block_table.size(0)), static_cast<int>(page_size),
                                     block_table.data_ptr<int32_t>(), static_cast<int>(block_table.size(1)),
                                     src_positions.data_ptr<int64_t>(), dst_start.data_ptr<int64_t>(),
                                     lengths.data_ptr<int32_t>(), static_cast<int>(src_positions.size(1)), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree_ext, CUDA, m) {
  m.impl("compact_kv_", &compact_kv_cuda);
  m.impl("compact_kv_layers_", &compact_kv_layers_cuda);
  m.impl("compact_kv_paged_", &compact_kv_paged_cuda);
}

}  // namespace dartree
