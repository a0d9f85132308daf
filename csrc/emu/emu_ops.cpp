// Test-only shared library: the unchanged kernels of csrc/kernels/ run on the CPU through the
// emulation runtime, behind a plain C ABI that python_tests/emulated.py calls with ctypes on
// CPU tensors' data pointers. Built by the tests with g++ (no torch headers, a few seconds), or
// with clang++ and -fsanitize-coverage=edge,trace-loads,trace-stores (DARTREE_EMU_INSTRUMENTED):
// then every load and store of the kernels calls the callbacks below, which count global-memory
// bytes and check them against the ranges the caller registered.
#include "emu_runtime.h"

#include <exception>
#include <sstream>
#include <string>

#include "../kernels/expand.cuh"
#include "../kernels/kv.cuh"
#include "../kernels/quant_linear.cuh"
#include "../kernels/select.cuh"
#include "../kernels/tree_mask.cuh"
#include "../kernels/vat.cuh"
#include "../kernels/verify.cuh"

#ifdef DARTREE_EMU_INSTRUMENTED
#define DARTREE_EMU_ACCESS_CALLBACK(name, bytes, write)                                              \
  extern "C" __attribute__((no_sanitize("coverage"), visibility("hidden"))) void name(void* address) { \
    ::dartree_emu::Runtime& rt = ::dartree_emu::runtime_instance;                                   \
    if (!rt.memory.in_kernel) return;                                                                \
    rt.memory.in_kernel = false;                                                                     \
    ::dartree_emu::record_access(rt, address, (bytes), (write));                                    \
    rt.memory.in_kernel = true;                                                                      \
  }
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_load1, 1, false)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_load2, 2, false)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_load4, 4, false)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_load8, 8, false)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_load16, 16, false)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_store1, 1, true)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_store2, 2, true)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_store4, 4, true)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_store8, 8, true)
DARTREE_EMU_ACCESS_CALLBACK(__sanitizer_cov_store16, 16, true)
#undef DARTREE_EMU_ACCESS_CALLBACK
#endif

namespace {

std::string last_error;
std::string traffic_report;

template <typename F>
int guarded(F&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// Self-test kernels: the emulation must prove it catches missing barriers.
template <bool kWithBarriers>
__global__ void block_sum_kernel(const int32_t* values, int count, int32_t* out) {
  DARTREE_SHARED_ARRAY(int32_t, partial, 1024);
  const int t = threadIdx.x;
  partial[t] = t < count ? values[t] : 0;
  if (kWithBarriers) __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    if (kWithBarriers) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

// Warp primitives: a shuffle-down tree sum per warp, a ballot of odd values, an atomic total.
__global__ void warp_primitives_kernel(const int32_t* values, int32_t* warp_sums, uint32_t* ballots,
                                       int32_t* atomic_total, int32_t* atomic_min) {
  const int t = threadIdx.x;
  const int lane = t % warpSize;
  int v = values[t];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(dartree::kernels::kFullWarpMask, v, offset);
  const unsigned odd = __ballot_sync(dartree::kernels::kFullWarpMask, values[t] & 1);
  const int broadcast = __shfl_sync(dartree::kernels::kFullWarpMask, v, 0);
  if (lane == 0) {
    warp_sums[t / warpSize] = broadcast;
    ballots[t / warpSize] = odd;
  }
  atomicAdd(atomic_total, values[t]);
  atomicMin(atomic_min, values[t]);
}

// Half the warp waits at __syncthreads, the other half at __syncwarp: neither can ever be
// released. The emulation must report it instead of hanging.
__global__ void divergent_barrier_kernel(int32_t* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

// Deliberately broken kernels for the emulation's own checks.
// Threads 16.. exit, the rest wait at __syncthreads (undefined in CUDA).
__global__ void exit_then_barrier_kernel(int32_t* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Lane 31 exits, the others shuffle with the full mask (undefined in CUDA).
__global__ void exit_then_shuffle_kernel(int32_t* out) {
  if (threadIdx.x % 32 == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(dartree::kernels::kFullWarpMask, static_cast<int>(threadIdx.x), 1);
}

// Writes shared memory at `offset` (in ints) of a `count`-int dynamic array (where = 0) or of a
// 33-int static array (where = 1): out of bounds for offset < 0 or >= the array's length.
__global__ void shared_write_kernel(int where, int offset, int32_t* out) {
  DARTREE_DYNAMIC_SHARED(int32_t, s_dynamic);
  DARTREE_SHARED_ARRAY(int32_t, s_static, 33);
  if (threadIdx.x == 0) {
    if (where == 0) s_dynamic[offset] = 7;
    else s_static[offset] = 7;
  }
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// Each block appends its index to `order` (one thread per block): the order blocks ran in.
__global__ void block_order_kernel(int32_t* order, int32_t* count) {
  if (threadIdx.x == 0) order[atomicAdd(count, 1)] = static_cast<int32_t>(blockIdx.x);
}

// out[i] = values[i] for i < count + extra, a thread per element: with extra > 0 it reads past
// the end of `values` (the instrumented build's bounds check must name it).
__global__ void copy_prefix_kernel(const int32_t* values, int count, int extra, int32_t* out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < count + extra) out[i] = values[i];
}

// Thread 0 of each block writes shared memory; block 0's writes out[0]. For launches of any shape.
__global__ void touch_kernel(int32_t* out) {
  DARTREE_DYNAMIC_SHARED(int32_t, s);
  const bool first = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
  if (first) s[0] = 1;
  if (first && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) out[0] = s[0];
}

// Deliberately racy kernels for the race detector's self-test (`kind`):
// 0: every thread adds to one shared counter without a barrier (read-write race on shared memory);
// 1: thread 0 writes shared memory, thread 33 (another warp) reads it with no __syncthreads;
// 2: the same with the __syncthreads (clean);
// 3: lane 0 writes shared memory, lane 1 of the same warp reads it after a __syncwarp (clean);
// 4: the same without the __syncwarp (a race: lanes of one warp are not in lockstep);
// 5: every block writes out[0] (a global write-write race between blocks);
// 6: each thread writes its own bf16-sized half of a word (clean: bytes, not words, conflict);
// 7: thread 0 reads one int past the shared array (out of bounds, not a race).
__global__ void racy_kernel(int kind, int32_t* out) {
  DARTREE_SHARED_ARRAY(int32_t, s, 64);
  const int t = static_cast<int>(threadIdx.x);
  if (t == 0) s[0] = 0;
  __syncthreads();
  switch (kind) {
    case 0: s[0] += 1; break;
    case 1: case 2:
      if (t == 0) s[1] = 5;
      if (kind == 2) __syncthreads();
      if (t == 33) out[0] = s[1];
      break;
    case 3: case 4:
      if (t == 0) s[2] = 7;
      if (kind == 3) __syncwarp();
      if (t == 1) out[1] = s[2];
      break;
    case 5: if (t == 0) out[0] = static_cast<int32_t>(blockIdx.x); break;
    case 6: reinterpret_cast<int16_t*>(out)[blockIdx.x * blockDim.x + t] = static_cast<int16_t>(t); break;
    case 7: if (t == 0) out[0] = s[64]; break;
    default: break;
  }
}

}  // namespace

extern "C" {

const char* emu_last_error() { return last_error.c_str(); }

int emu_instrumented() {
#ifdef DARTREE_EMU_INSTRUMENTED
  return 1;
#else
  return 0;
#endif
}

// The global-memory ranges (begin, end pairs) the next launches may touch; count < 0 stops checking.
// Only the instrumented build checks.
int emu_set_global_ranges(const uint64_t* pairs, int count) {
  return guarded([&] {
    dartree_emu::Runtime& rt = dartree_emu::runtime();
    std::lock_guard<std::mutex> lock(rt.launch_mutex);
    rt.memory.registered.clear();
    rt.memory.checking = count >= 0;
    for (int i = 0; i < count; ++i)
      if (pairs[2 * i + 1] > pairs[2 * i]) rt.memory.registered.push_back({pairs[2 * i], pairs[2 * i + 1]});
    std::sort(rt.memory.registered.begin(), rt.memory.registered.end(),
              [](const dartree_emu::AddressRange& a, const dartree_emu::AddressRange& b) { return a.begin < b.begin; });
  });
}

// Every launch so far, one line per kernel: "name launches read_bytes write_bytes" (bytes are
// counted by the instrumented build only).
const char* emu_kernel_traffic() {
  dartree_emu::Runtime& rt = dartree_emu::runtime();
  std::lock_guard<std::mutex> lock(rt.launch_mutex);
  std::ostringstream out;
  for (const auto& [name, traffic] : rt.memory.per_kernel)
    out << name << ' ' << traffic.launches << ' ' << traffic.read_bytes << ' ' << traffic.write_bytes << '\n';
  traffic_report = out.str();
  return traffic_report.c_str();
}

void emu_reset_kernel_traffic() {
  dartree_emu::Runtime& rt = dartree_emu::runtime();
  std::lock_guard<std::mutex> lock(rt.launch_mutex);
  rt.memory.per_kernel.clear();
}

// 0: forward thread order, 1: reverse, 2: shuffled at every sweep (seeded).
int emu_set_schedule(int mode, uint64_t seed) {
  return guarded([&] {
    if (mode < 0 || mode > 2) throw std::invalid_argument("schedule must be 0, 1 or 2");
    dartree_emu::set_schedule(static_cast<dartree_emu::Schedule>(mode), seed);
  });
}

int emu_block_sum(const int32_t* values, int count, int threads, int with_barriers, int32_t* out) {
  return guarded([&] {
    if (with_barriers) {
      DARTREE_LAUNCH(block_sum_kernel<true>, dim3(1), dim3(threads), 0, nullptr, values, count, out);
    } else {
      DARTREE_LAUNCH(block_sum_kernel<false>, dim3(1), dim3(threads), 0, nullptr, values, count, out);
    }
  });
}

int emu_warp_primitives(const int32_t* values, int threads, int32_t* warp_sums, uint32_t* ballots,
                        int32_t* atomic_total, int32_t* atomic_min) {
  return guarded([&] {
    DARTREE_LAUNCH(warp_primitives_kernel, dim3(1), dim3(threads), 0, nullptr, values, warp_sums, ballots,
                   atomic_total, atomic_min);
  });
}

int emu_block_order(int blocks, int32_t* order, int32_t* count) {
  return guarded([&] { DARTREE_LAUNCH(block_order_kernel, dim3(blocks), dim3(32), 0, nullptr, order, count); });
}

int emu_shared_write(int where, int count, int offset, int32_t* out) {
  return guarded([&] {
    DARTREE_LAUNCH(shared_write_kernel, dim3(2), dim3(32), sizeof(int32_t) * static_cast<size_t>(count), nullptr,
                   where, offset, out);
  });
}

int emu_copy_prefix(const int32_t* values, int count, int extra, int32_t* out) {
  return guarded([&] {
    const int n = count + extra;
    DARTREE_LAUNCH(copy_prefix_kernel, dim3(static_cast<unsigned>((n + 31) / 32)), dim3(32), 0, nullptr, values,
                   count, extra, out);
  });
}

int emu_exit_then_barrier(int32_t* out) {
  return guarded([&] { DARTREE_LAUNCH(exit_then_barrier_kernel, dim3(1), dim3(32), 0, nullptr, out); });
}

int emu_exit_then_shuffle(int32_t* out) {
  return guarded([&] { DARTREE_LAUNCH(exit_then_shuffle_kernel, dim3(1), dim3(32), 0, nullptr, out); });
}

int emu_launch_shape(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, int64_t shared_bytes,
                     int32_t* out) {
  return guarded([&] {
    DARTREE_LAUNCH(touch_kernel, dim3(gx, gy, gz), dim3(bx, by, bz), static_cast<size_t>(shared_bytes), nullptr, out);
  });
}

int emu_racy(int kind, int blocks, int32_t* out) {
  return guarded([&] { DARTREE_LAUNCH(racy_kernel, dim3(blocks), dim3(64), 0, nullptr, kind, out); });
}

// Data-race detection of the instrumented build: on (default) or off.
void emu_set_race_detection(int on) {
  dartree_emu::Runtime& rt = dartree_emu::runtime();
  std::lock_guard<std::mutex> lock(rt.launch_mutex);
  rt.races.enabled = on != 0;
}

int emu_divergent_barrier(int32_t* out) {
  return guarded([&] { DARTREE_LAUNCH(divergent_barrier_kernel, dim3(1), dim3(32), 0, nullptr, out); });
}

int emu_tree_ancestor_bits(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max, uint64_t* bits,
                           int32_t* depths) {
  return guarded([&] {
    dartree::kernels::launch_tree_ancestor_bits(parents, num_nodes, batch, n_max, bits, depths, nullptr);
  });
}

int emu_tree_attention_mask(const int32_t* parents, const int32_t* num_nodes, const uint8_t* past_key_mask,
                            int batch, int n_max, int past, int element_bytes, uint64_t hidden, void* out) {
  return guarded([&] {
    if (element_bytes != 2 && element_bytes != 4 && element_bytes != 8)
      throw std::invalid_argument("unsupported element size");
    dartree::kernels::launch_tree_attention_mask(parents, num_nodes, past_key_mask, batch, n_max, past, element_bytes,
                                                 hidden, out, nullptr);
  });
}

int emu_tree_links(const int32_t* parents, const int32_t* num_nodes, int batch, int n_max, int32_t* next_token,
                   int32_t* next_sibling) {
  return guarded([&] {
    dartree::kernels::launch_tree_links(parents, num_nodes, batch, n_max, next_token, next_sibling, nullptr);
  });
}

int emu_packed_tree_mask(const uint64_t* bits, const int64_t* seq_lens, const int32_t* mask_indptr, int batch,
                         int n_max, int64_t total_bytes, uint8_t* out) {
  return guarded([&] {
    dartree::kernels::launch_packed_tree_mask(bits, seq_lens, mask_indptr, batch, n_max, total_bytes, out, nullptr);
  });
}

int emu_verify_tree(const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                    const int64_t* target_tokens, int batch, int n_max, int32_t* accept_nodes, int32_t* accept_len,
                    int64_t* bonus) {
  return guarded([&] {
    dartree::kernels::launch_verify_tree(tokens, parents, num_nodes, target_tokens, batch, n_max, accept_nodes,
                                         accept_len, bonus, nullptr);
  });
}

int emu_quant_linear(const float* x, const uint8_t* blocks, const float* bias, int kind, int rows, int in, int out,
                     int64_t row_bytes, float* y) {
  return guarded([&] {
    dartree::kernels::launch_quant_linear(x, blocks, bias, kind, rows, in, out, row_bytes, y, nullptr);
  });
}

int emu_select_top_w(const float* parent_scores, const float* child_logprobs, const int32_t* num_parents, int batch,
                     int p_max, int k, int width, int32_t* parent_idx, int32_t* child_k, float* scores) {
  return guarded([&] {
    dartree::kernels::launch_select_top_w(parent_scores, child_logprobs, num_parents, batch, p_max, k, width,
                                          parent_idx, child_k, scores, nullptr);
  });
}

int emu_select_top_b(const int32_t* parents, const float* scores, const int32_t* num_nodes, int batch, int n_max,
                     int budget, int32_t* keep, int32_t* new_parents, int32_t* num_kept) {
  return guarded([&] {
    dartree::kernels::launch_select_top_b(parents, scores, num_nodes, batch, n_max, budget, keep, new_parents,
                                          num_kept, nullptr);
  });
}

int emu_ddtree_heap(const float* logprobs, const int64_t* token_ids, const int64_t* root_tokens, int batch,
                    int depth_max, int k, int budget, int64_t* tokens, int32_t* parents, int32_t* depths,
                    float* scores, int32_t* num_nodes) {
  return guarded([&] {
    dartree::kernels::launch_ddtree_heap(logprobs, token_ids, root_tokens, batch, depth_max, k, budget, tokens,
                                         parents, depths, scores, num_nodes, nullptr);
  });
}

int emu_expand_depth(const dartree::kernels::HeadWeightPtrs* head, const dartree::kernels::ExpandInputs* in,
                     float* workspace, const dartree::kernels::ExpandOutputs* out) {
  return guarded([&] { dartree::kernels::launch_expand_depth(*head, *in, workspace, *out, nullptr); });
}

int emu_build_supertree(const dartree::kernels::HeadWeightPtrs* head, const dartree::kernels::SupertreeArgs* args) {
  return guarded([&] { dartree::kernels::launch_build_supertree(*head, *args, nullptr); });
}

int emu_compact_kv_paged(void* const* bases, const int64_t* row_units, int count, int unit_bytes, int batch,
                         int page_size, const int32_t* block_table, int max_pages, const int64_t* src_positions,
                         const int64_t* dst_start, const int32_t* lengths, int l_max, int64_t num_pages) {
  return guarded([&] {
    if (count > dartree::kernels::kMaxPagedCaches) throw std::invalid_argument("too many pools for one launch");
    dartree::kernels::PagedKvCaches pools{};
    pools.num_pages = num_pages;
    for (int c = 0; c < count; ++c) {
      pools.base[c] = bases[c];
      pools.row_units[c] = row_units[c];
    }
    pools.count = count;
    dartree::kernels::launch_compact_kv_paged(pools, unit_bytes, batch, page_size, block_table, max_pages,
                                              src_positions, dst_start, lengths, l_max, nullptr);
  });
}

int emu_compact_kv_layers(void* const* bases, const int64_t* row_units, const int32_t* heads, int count,
                          int unit_bytes, int batch, int64_t seq, const int64_t* src_positions,
                          const int64_t* dst_start, const int32_t* lengths, int l_max) {
  return guarded([&] {
    if (count > dartree::kernels::kMaxKvLayerCaches) throw std::invalid_argument("too many caches for one launch");
    dartree::kernels::LayerKvCaches caches{};
    for (int c = 0; c < count; ++c) {
      caches.base[c] = bases[c];
      caches.row_units[c] = row_units[c];
      caches.heads[c] = heads[c];
    }
    caches.count = count;
    dartree::kernels::launch_compact_kv_layers(caches, unit_bytes, batch, seq, src_positions, dst_start, lengths,
                                               l_max, nullptr);
  });
}

int emu_vat_row_forward(int dtype, const void* draft, const void* target, const int64_t* tokens,
                        const float* uniforms, int64_t rows, int64_t vocab, double temperature, void* ce_soft,
                        void* ce_hard, void* draft_lse, void* target_lse, float* accept) {
  return guarded([&] {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("unsupported dtype");
    dartree::kernels::launch_vat_row_forward(static_cast<dartree::kernels::ElemType>(dtype), draft, target, tokens,
                                             uniforms, rows, vocab, temperature, ce_soft, ce_hard, draft_lse,
                                             target_lse, accept, nullptr);
  });
}

int emu_vat_row_backward(int dtype, const void* draft, const void* target, const int64_t* tokens,
                         const void* draft_lse, const void* target_lse, const void* g_q, const void* g_p,
                         const void* g_y, int64_t rows, int64_t vocab, void* grad_draft) {
  return guarded([&] {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("unsupported dtype");
    dartree::kernels::launch_vat_row_backward(static_cast<dartree::kernels::ElemType>(dtype), draft, target, tokens,
                                              draft_lse, target_lse, g_q, g_p, g_y, rows, vocab, grad_draft, nullptr);
  });
}

int emu_vat_block_weights(const float* accept, const uint8_t* valid, int64_t blocks, int k, int schedule,
                          double decay_gamma, int32_t* first_reject, float* weights) {
  return guarded([&] {
    dartree::kernels::launch_vat_block_weights(accept, valid, blocks, k, schedule, decay_gamma, first_reject,
                                               weights, nullptr);
  });
}

size_t emu_struct_sizes(int which) {  // lets the ctypes mirrors check their layout
  switch (which) {
    case 0: return sizeof(dartree::kernels::HeadWeightPtrs);
    case 1: return sizeof(dartree::kernels::ExpandInputs);
    case 2: return sizeof(dartree::kernels::ExpandOutputs);
    default: return sizeof(dartree::kernels::SupertreeArgs);
  }
}

}  // extern "C"
