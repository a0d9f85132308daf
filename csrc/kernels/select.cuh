// Device code for the selection ops: top-W children of a depth (DARTree expansion), top-B pruning
// of a materialized tree (heap semantics, Lemma 1 fast path), and DDTree's best-first heap.
//
// One total order everywhere: a candidate is better if its score is higher, or equal with a lower
// index. NaN scores are read as -inf, so every backend orders the same way.
#pragma once

#include "block_ops.cuh"

namespace dartree {
namespace kernels {

constexpr int kSelectThreads = 256;

// ---- select_top_w ------------------------------------------------------------------------------
// grid (B). Round t finds the best candidate strictly worse than round t-1's pick, so nothing has
// to be marked as taken. W rounds of one block reduction each.
__global__ void select_top_w_kernel(const float* parent_scores, const float* child_logprobs, const int32_t* num_parents,
                                    int p_max, int k, int width, int32_t* parent_idx, int32_t* child_k,
                                    float* scores) {
  DARTREE_SHARED_ARRAY(Candidate, s_scratch, 33);
  const int b = blockIdx.x;
  int parents_here = num_parents[b];
  parents_here = parents_here < 0 ? 0 : (parents_here > p_max ? p_max : parents_here);
  const int count = parents_here * k;
  const float* row_parent = parent_scores + static_cast<int64_t>(b) * p_max;
  const float* row_child = child_logprobs + static_cast<int64_t>(b) * p_max * k;
  const int64_t out_base = static_cast<int64_t>(b) * width;
  Candidate previous{kPosInf, -1};
  int t = 0;
  for (; t < width; ++t) {
    Candidate mine{kNegInf, kNoCandidate};
    for (int c = threadIdx.x; c < count; c += blockDim.x) {
      const float s = sanitize_score(row_parent[c / k] + row_child[c]);
      if (better(previous.score, previous.index, s, c)) mine = better_of(mine, Candidate{s, c});
    }
    const Candidate best = block_best(mine, s_scratch);
    if (best.index == kNoCandidate) break;  // uniform: every thread holds the same best
    if (threadIdx.x == 0) {
      parent_idx[out_base + t] = best.index / k;
      child_k[out_base + t] = best.index % k;
      scores[out_base + t] = best.score;
    }
    previous = best;
  }
  for (int r = t + threadIdx.x; r < width; r += blockDim.x) {
    parent_idx[out_base + r] = -1;
    child_k[out_base + r] = -1;
    scores[out_base + r] = kNegInf;
  }
}

void launch_select_top_w(const float* parent_scores, const float* child_logprobs, const int32_t* num_parents,
                                int batch, int p_max, int k, int width, int32_t* parent_idx, int32_t* child_k,
                                float* scores, cudaStream_t stream) {
  if (batch == 0 || width == 0) return;
  DARTREE_LAUNCH(select_top_w_kernel, dim3(static_cast<unsigned>(batch)), dim3(kSelectThreads), 0, stream,
                 parent_scores, child_logprobs, num_parents, p_max, k, width, parent_idx, child_k, scores);
}

// ---- select_top_b ------------------------------------------------------------------------------
// grid (B). Shared: scores (reused as the new index of each node once chosen) and a kept flag.
// Fast path (scores never increase from parent to child): a node is kept iff fewer than `budget`
// non-root nodes beat it in the total order (Lemma 1: that set is prefix-closed and equals the
// heap's). Otherwise the heap is run as `budget` rounds of "best node whose parent is kept".
__global__ void select_top_b_kernel(const int32_t* parents, const float* scores, const int32_t* num_nodes, int n_max,
                                    int budget, int32_t* keep, int32_t* new_parents, int32_t* num_kept) {
  DARTREE_DYNAMIC_SHARED(float, s_score);
  uint8_t* s_kept = reinterpret_cast<uint8_t*>(s_score + n_max);
  int* s_index = reinterpret_cast<int*>(s_score);  // aliases s_score after selection
  DARTREE_SHARED_ARRAY(Candidate, s_best, 33);
  DARTREE_SHARED_ARRAY(int, s_scan, 33);
  const int b = blockIdx.x;
  const int n = sanitized_count(num_nodes[b], n_max);
  const int32_t* row_parents = parents + static_cast<int64_t>(b) * n_max;
  const float* row_scores = scores + static_cast<int64_t>(b) * n_max;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    s_score[i] = sanitize_score(row_scores[i]);
    s_kept[i] = i == 0 ? 1 : 0;
  }
  __syncthreads();
  int increases = 0;  // a child scored above its parent: the fast path does not apply
  for (int i = 1 + threadIdx.x; i < n; i += blockDim.x) {
    const int p = sanitized_parent(row_parents, i, n);
    if (p >= 0 && s_score[i] > s_score[p]) increases = 1;
  }
  if (!__syncthreads_or(increases)) {
    for (int i = 1 + threadIdx.x; i < n; i += blockDim.x) {
      const float s = s_score[i];
      int rank = 0;
      for (int j = 1; j < n && rank < budget; ++j) rank += better(s_score[j], j, s, i) ? 1 : 0;
      s_kept[i] = rank < budget ? 1 : 0;
    }
  } else {
    for (int round = 0; round < budget; ++round) {
      Candidate mine{kNegInf, kNoCandidate};
      for (int i = 1 + threadIdx.x; i < n; i += blockDim.x) {
        const int p = sanitized_parent(row_parents, i, n);
        if (!s_kept[i] && p >= 0 && s_kept[p]) mine = better_of(mine, Candidate{s_score[i], i});
      }
      const Candidate best = block_best(mine, s_best);
      if (best.index == kNoCandidate) break;
      if (threadIdx.x == 0) s_kept[best.index] = 1;
      __syncthreads();
    }
  }
  __syncthreads();

  // compaction in index order: each thread owns a contiguous chunk of nodes
  const int chunk = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min_int(n, threadIdx.x * chunk), end = min_int(n, begin + chunk);
  int mine = 0;
  for (int i = begin; i < end; ++i) mine += s_kept[i];
  int total = 0;
  int next = block_exclusive_scan(mine, s_scan, &total);
  for (int i = begin; i < end; ++i) s_index[i] = s_kept[i] ? next++ : -1;
  __syncthreads();
  const int64_t out_base = static_cast<int64_t>(b) * (budget + 1);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int slot = s_index[i];
    if (slot < 0) continue;
    const int p = sanitized_parent(row_parents, i, n);
    keep[out_base + slot] = i;
    new_parents[out_base + slot] = p >= 0 ? s_index[p] : -1;
  }
  for (int slot = total + threadIdx.x; slot < budget + 1; slot += blockDim.x) {
    keep[out_base + slot] = -1;
    new_parents[out_base + slot] = -1;
  }
  if (threadIdx.x == 0) num_kept[b] = total;
}

inline size_t select_top_b_shared_bytes(int n_max) { return (sizeof(float) + 1) * static_cast<size_t>(n_max); }

void launch_select_top_b(const int32_t* parents, const float* scores, const int32_t* num_nodes, int batch,
                                int n_max, int budget, int32_t* keep, int32_t* new_parents, int32_t* num_kept,
                                cudaStream_t stream) {
  if (batch == 0) return;
  DARTREE_LAUNCH(select_top_b_kernel, dim3(static_cast<unsigned>(batch)), dim3(kSelectThreads),
                 select_top_b_shared_bytes(n_max), stream, parents, scores, num_nodes, n_max, budget, keep,
                 new_parents, num_kept);
}

// ---- ddtree_heap -------------------------------------------------------------------------------
// One thread per request, its binary heap in shared memory (at most budget + 1 entries: each pop
// pushes at most two). Entries are prefixes: (score, push sequence, parent node, depth, rank);
// ties in score go to the earlier push, which the Python heapq reference reproduces.
struct HeapEntry {
  float score;
  int seq;
  int parent;
  int code;  // depth << 16 | rank
};

DARTREE_DEVICE bool heap_before(const HeapEntry& a, const HeapEntry& b) {
  return a.score > b.score || (a.score == b.score && a.seq < b.seq);
}

DARTREE_DEVICE void heap_push(HeapEntry* heap, int& size, HeapEntry e) {
  int i = size++;
  while (i > 0) {
    const int up = (i - 1) / 2;
    if (!heap_before(e, heap[up])) break;
    heap[i] = heap[up];
    i = up;
  }
  heap[i] = e;
}

DARTREE_DEVICE HeapEntry heap_pop(HeapEntry* heap, int& size) {
  const HeapEntry top = heap[0];
  const HeapEntry last = heap[--size];
  int i = 0;
  for (;;) {
    int child = 2 * i + 1;
    if (child >= size) break;
    if (child + 1 < size && heap_before(heap[child + 1], heap[child])) ++child;
    if (!heap_before(heap[child], last)) break;
    heap[i] = heap[child];
    i = child;
  }
  if (size > 0) heap[i] = last;
  return top;
}

// One block (one warp) per request. The block first stages the request's candidates in shared
// memory (log-probabilities, then token ids, as far as 48 KiB allow next to the heap), so the
// sequential pop / push loop on thread 0 reads shared memory, not dependent global loads; the
// node scores a push reads back live in shared memory too. After the loop every thread writes
// the padding.
constexpr int kDdtreeThreads = 32;

struct DdtreeSharedLayout {
  bool stage_lp, stage_ids;
  size_t bytes;
};

inline DdtreeSharedLayout ddtree_shared_layout(int depth_max, int k, int budget) {
  const size_t limit = 48 * 1024, candidates = static_cast<size_t>(depth_max) * k;
  const size_t base = (sizeof(HeapEntry) + sizeof(float)) * static_cast<size_t>(budget + 1);
  DdtreeSharedLayout layout{false, false, base};
  if (layout.bytes + candidates * sizeof(float) <= limit) {
    layout.stage_lp = true;
    layout.bytes += candidates * sizeof(float);
  }
  if (layout.stage_lp && layout.bytes + candidates * sizeof(int64_t) <= limit) {
    layout.stage_ids = true;
    layout.bytes += candidates * sizeof(int64_t);
  }
  return layout;
}

__global__ void ddtree_heap_kernel(const float* logprobs, const int64_t* token_ids, const int64_t* root_tokens,
                                   int depth_max, int k, int budget, int stage_lp, int stage_ids, int64_t* tokens,
                                   int32_t* parents, int32_t* depths, float* scores, int32_t* num_nodes) {
  DARTREE_DYNAMIC_SHARED(HeapEntry, s_heap);  // layout: heap | token ids? | log-probs? | node scores
  DARTREE_SHARED_ARRAY(int, s_count, 1);
  const int b = blockIdx.x;
  const int64_t candidates = static_cast<int64_t>(depth_max) * k;
  const float* g_lp = logprobs + static_cast<int64_t>(b) * candidates;
  const int64_t* g_ids = token_ids + static_cast<int64_t>(b) * candidates;
  char* cursor = reinterpret_cast<char*>(s_heap + (budget + 1));
  int64_t* s_ids = stage_ids ? reinterpret_cast<int64_t*>(cursor) : nullptr;
  cursor += stage_ids ? candidates * static_cast<int64_t>(sizeof(int64_t)) : 0;
  float* s_lp = stage_lp ? reinterpret_cast<float*>(cursor) : nullptr;
  cursor += stage_lp ? candidates * static_cast<int64_t>(sizeof(float)) : 0;
  float* s_score = reinterpret_cast<float*>(cursor);
  for (int64_t i = threadIdx.x; i < candidates; i += blockDim.x) {
    if (s_lp) s_lp[i] = g_lp[i];
    if (s_ids) s_ids[i] = g_ids[i];
  }
  __syncthreads();
  const float* lp = s_lp ? s_lp : g_lp;
  const int64_t* ids = s_ids ? s_ids : g_ids;
  const int64_t base = static_cast<int64_t>(b) * (budget + 1);
  int64_t* out_tokens = tokens + base;
  int32_t* out_parents = parents + base;
  int32_t* out_depths = depths + base;
  float* out_scores = scores + base;

  if (threadIdx.x == 0) {
    out_tokens[0] = root_tokens[b];
    out_parents[0] = -1;
    out_depths[0] = 0;
    out_scores[0] = 0.0f;
    s_score[0] = 0.0f;
    int size = 0, seq = 0, count = 1;
    if (budget > 0 && depth_max > 0 && k > 0) heap_push(s_heap, size, HeapEntry{lp[0], seq++, 0, (1 << 16)});
    while (count <= budget && size > 0) {
      const HeapEntry e = heap_pop(s_heap, size);
      const int d = e.code >> 16, r = e.code & 0xffff;
      const int node = count++;
      out_tokens[node] = ids[(d - 1) * k + r];
      out_parents[node] = e.parent;
      out_depths[node] = d;
      out_scores[node] = e.score;
      s_score[node] = e.score;
      if (count > budget) break;  // nothing pushed now could be popped
      if (r + 1 < k)
        heap_push(s_heap, size, HeapEntry{s_score[e.parent] + lp[(d - 1) * k + r + 1], seq++, e.parent, (d << 16) | (r + 1)});
      if (d < depth_max) heap_push(s_heap, size, HeapEntry{e.score + lp[d * k], seq++, node, ((d + 1) << 16)});
    }
    s_count[0] = count;
    num_nodes[b] = count;
  }
  __syncthreads();
  for (int i = s_count[0] + static_cast<int>(threadIdx.x); i <= budget; i += blockDim.x) {
    out_tokens[i] = 0;
    out_parents[i] = -1;
    out_depths[i] = -1;
    out_scores[i] = kNegInf;
  }
}

void launch_ddtree_heap(const float* logprobs, const int64_t* token_ids, const int64_t* root_tokens, int batch,
                               int depth_max, int k, int budget, int64_t* tokens, int32_t* parents, int32_t* depths,
                               float* scores, int32_t* num_nodes, cudaStream_t stream) {
  if (batch == 0) return;
  const DdtreeSharedLayout layout = ddtree_shared_layout(depth_max, k, budget);
  DARTREE_LAUNCH(ddtree_heap_kernel, dim3(static_cast<unsigned>(batch)), dim3(kDdtreeThreads), layout.bytes, stream,
                 logprobs, token_ids, root_tokens, depth_max, k, budget, layout.stage_lp ? 1 : 0,
                 layout.stage_ids ? 1 : 0, tokens, parents, depths, scores, num_nodes);
}

}  // namespace kernels
}  // namespace dartree
