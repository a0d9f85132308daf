// Device code for DARTree's depth-wise tree expansion with a GRU correction head (DESIGN.md):
// for every active parent u of a depth, corrected logits of the K candidates
//   L[k] = cand_base[k] + fc2_weight[cand_ids[k]] . SiLU(z + w_s s(u)) (+ fc2_bias[cand_ids[k]]),
// log-softmax over the K candidates, child score = s(u) + log q + depth_bonus, the top-W children
// of the depth, and the GRU update of the kept children's states. Only the K candidate rows of
// fc2 are read: nothing of size V is touched per depth.
//
// Four kernels per depth, each reading its weights once per launch (weight-stationary):
//   expand_hidden   grid (E / 8, chunks of 16 parents): SiLU(z + w_s s(u)) for all B x P parents;
//                   each warp takes a row of w_s over the chunk's states staged in shared memory.
//   expand_logits   grid (K / 8, B): the K candidates' fc2 rows times the P parents' hidden
//                   vectors; each warp takes one candidate's row over the request's hidden
//                   vectors staged in shared memory (each fc2 row read once per request).
//   expand_select   grid (B): per request, the log-softmax over K per parent and the top-W
//                   children (per-warp lists, merged), and a copy of each child's parent state
//                   for the update.
//   expand_update   grid (G / 8, chunks of 16 children), not launched for the last depth: w_hh h
//                   for all B x W children, each warp taking the r / z / n rows of one state
//                   element, and the GRU gates in the epilogue.
// At the paper's sizes every kernel is bound by the latency of global loads, not by bandwidth
// (a few MB a depth): each thread issues a batch of independent loads before using any
// (batched_copy, lane_partial_dots), and the per-row epilogues run one row per lane, so their
// dependent loads (a token, then its gru_table row) overlap instead of running one row at a time.
// Weights and activations are float32, bfloat16 or float16 (read through `Elem`); accumulation,
// scores and states float32. Workspace: expand_workspace_floats() floats (launchers.h).
#pragma once

#include "block_ops.cuh"
#include "elem.cuh"

namespace dartree {
namespace kernels {

constexpr int kRowsPerChunk = 16;       // activation rows staged in shared memory at a time (at most)
constexpr int kStageFloats = 8192;      // 32 KiB of staged activations

DARTREE_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Rows of activations staged per chunk: as many as fit kStageFloats, at most kRowsPerChunk.
DARTREE_HOST_DEVICE int stage_rows(int cols) {
  const int rows = kStageFloats / (cols > 0 ? cols : 1);
  return rows < 1 ? 1 : (rows > kRowsPerChunk ? kRowsPerChunk : rows);
}

template <typename Elem>
struct TypedHeadWeightPtrs {  // HeadWeightPtrs with pointers of the element type, as the kernels take them
  const Elem* w_s;         // [E, G]
  const Elem* fc2_weight;  // [V, E]
  const Elem* fc2_bias;    // [V] or null
  const Elem* gru_table;   // [V, 3G]
  const Elem* w_hh;        // [3G, G]
  const Elem* b_hh;        // [3G] or null
  int e, g;
  int64_t v;
};

// Global loads a thread issues before it uses any of them: the kernels here are bound by the
// latency of dependent loads, not by bandwidth, so every staging loop loads a batch into
// registers first (independent loads in flight together) and only then stores or multiplies.
constexpr int kLoadBatch = 8;

// For i = first, first + stride, ... below n: store(i, load(i)), kLoadBatch loads in flight per
// thread (first / stride: threadIdx.x / blockDim.x for a block's copy, lane / warpSize for a warp's).
template <typename Load, typename Store>
DARTREE_DEVICE void batched_copy(int first, int stride, int n, Load load, Store store) {
  for (int i0 = first; i0 < n; i0 += kLoadBatch * stride) {
    float v[kLoadBatch];
DARTREE_UNROLL
    for (int q = 0; q < kLoadBatch; ++q) {
      const int i = i0 + q * stride;
      v[q] = i < n ? load(i) : 0.0f;
    }
DARTREE_UNROLL
    for (int q = 0; q < kLoadBatch; ++q) {
      const int i = i0 + q * stride;
      if (i < n) store(i, v[q]);
    }
  }
}

// Stage activation rows [row0, row0 + n) of x [rows, cols] (float32) in shared memory; rows past
// `rows` read as 0. All threads of the block call it.
DARTREE_DEVICE void stage_activations(const float* x, int64_t rows, int cols, int64_t row0, int n, float* s_x) {
  batched_copy(
      threadIdx.x, blockDim.x, n * cols,
      [&](int i) {
        const int64_t r = row0 + i / cols;
        return r < rows ? x[r * cols + i % cols] : 0.0f;
      },
      [&](int i, float v) { s_x[i] = v; });
}

// This lane's share (columns lane, lane + 32, ...) of the dot products of kRows weight rows
// with the n activation rows staged in s_x: acc[r][i] for r < n. A null row (past the matrix)
// contributes 0. The caller reduces over the warp.
template <int kRows, typename Elem>
DARTREE_DEVICE void lane_partial_dots(const Elem* const (&w_rows)[kRows], const float* s_x, int n, int cols,
                                      float (&acc)[kRowsPerChunk][kRows]) {
DARTREE_UNROLL
  for (int r = 0; r < kRowsPerChunk; ++r)
DARTREE_UNROLL
    for (int i = 0; i < kRows; ++i) acc[r][i] = 0.0f;
  // kColBatch columns' weights loaded before any is used; each lane still adds its columns in
  // increasing order (the same sums as one column at a time)
  constexpr int kColBatch = kRows == 1 ? kLoadBatch : kLoadBatch / 2;
  for (int c0 = threadIdx.x % warpSize; c0 < cols; c0 += kColBatch * warpSize) {
    float w[kColBatch][kRows];
DARTREE_UNROLL
    for (int q = 0; q < kColBatch; ++q) {
      const int c = c0 + q * warpSize;
DARTREE_UNROLL
      for (int i = 0; i < kRows; ++i) w[q][i] = (c < cols && w_rows[i] != nullptr) ? to_float(w_rows[i][c]) : 0.0f;
    }
DARTREE_UNROLL
    for (int q = 0; q < kColBatch; ++q) {
      const int c = c0 + q * warpSize;
      if (c >= cols) break;
DARTREE_UNROLL
      for (int r = 0; r < kRowsPerChunk; ++r) {
        if (r < n) {
          const float x = s_x[r * cols + c];
DARTREE_UNROLL
          for (int i = 0; i < kRows; ++i) acc[r][i] += w[q][i] * x;
        }
      }
    }
  }
}

// The warp's sums of lane_partial_dots' rows, handed out one row per lane: lane r < n gets row r's
// kRows sums in `mine` (every lane computes every butterfly sum, the same bits), so the rows'
// epilogues and their dependent loads run side by side instead of one row after another.
template <int kRows>
DARTREE_DEVICE void row_sums_by_lane(const float (&acc)[kRowsPerChunk][kRows], int n, float (&mine)[kRows]) {
DARTREE_UNROLL
  for (int i = 0; i < kRows; ++i) mine[i] = 0.0f;
DARTREE_UNROLL
  for (int r = 0; r < kRowsPerChunk; ++r) {
    if (r >= n) break;  // uniform per warp
    float sums[kRows];
DARTREE_UNROLL
    for (int i = 0; i < kRows; ++i) sums[i] = warp_sum(acc[r][i]);
    if (static_cast<int>(threadIdx.x % warpSize) == r) {
DARTREE_UNROLL
      for (int i = 0; i < kRows; ++i) mine[i] = sums[i];
    }
  }
}

// grid (ceil(E / warps), ceil(R / rows_per_block)), R = B x P: hidden[r, e] = SiLU(z[b(r), e]
// + sum_g w_s[e, g] states[r, g]). Each warp reads its row of w_s once per staged chunk of
// parents and keeps per-lane partial sums for every staged row; one warp reduction per output.
template <typename Elem>
__global__ void expand_hidden_kernel(TypedHeadWeightPtrs<Elem> head, ExpandInputs in, float* hidden,
                                     int rows_per_block) {
  DARTREE_DYNAMIC_SHARED(float, s_x);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int g = head.g, e = head.e;
  const int64_t rows = static_cast<int64_t>(in.batch) * in.p_max;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  const int chunk = stage_rows(g);
  const int e0 = blockIdx.x * warps + warp;  // this warp's row of w_s
  const Elem* const w_row[1] = {e0 < e ? head.w_s + static_cast<int64_t>(e0) * g : nullptr};
  for (int64_t row0 = first; row0 < last; row0 += chunk) {
    const int n = static_cast<int>(last - row0 < chunk ? last - row0 : chunk);
    __syncthreads();
    stage_activations(in.parent_states, rows, g, row0, n, s_x);
    __syncthreads();
    float acc[kRowsPerChunk][1];
    lane_partial_dots(w_row, s_x, n, g, acc);
    float mine[1];  // lane r: row row0 + r
    row_sums_by_lane(acc, n, mine);
    if (lane < n && e0 < e) {
      const int64_t row = row0 + lane;
      const Elem* z_row = static_cast<const Elem*>(in.z) + (row / in.p_max) * in.z_stride;
      const float a = mine[0] + to_float(z_row[e0]);
      hidden[row * e + e0] = a * sigmoid(a);  // SiLU
    }
  }
}

// A lane's first kLaneCache entries of a warp-strided list (indices lane, lane + 32, ...), kept
// in registers across the W rounds of a top-W selection instead of re-read every round.
constexpr int kLaneCache = 4;
struct LaneCandidates {
  Candidate c[kLaneCache];
};

// Entry i of a list: its sanitized score and its index (idx_base + i, or indices[i] when given).
DARTREE_DEVICE Candidate list_entry(const float* values, const int* indices, int idx_base, int i) {
  return Candidate{sanitize_score(values[i]), indices != nullptr ? indices[i] : idx_base + i};
}

DARTREE_DEVICE LaneCandidates lane_candidates(const float* values, const int* indices, int n, int idx_base) {
  LaneCandidates out;
DARTREE_UNROLL
  for (int q = 0; q < kLaneCache; ++q) {
    const int i = threadIdx.x % warpSize + q * warpSize;
    out.c[q] = i < n ? list_entry(values, indices, idx_base, i) : Candidate{kNegInf, kNoCandidate};
  }
  return out;
}

// Next best of the list [0, n) after `previous` in the selection order (higher score, then lower
// index), over one warp: each lane takes its cached entries, then scans the rest of its indices
// (past kLaneCache x 32) in memory. Every lane gets the result.
DARTREE_DEVICE Candidate warp_next_best(const LaneCandidates& cached, const float* values, const int* indices, int n,
                                        int idx_base, Candidate previous) {
  Candidate mine{kNegInf, kNoCandidate};
  const auto consider = [&](Candidate c) {
    if (c.index != kNoCandidate && better(previous.score, previous.index, c.score, c.index)) mine = better_of(mine, c);
  };
DARTREE_UNROLL
  for (int q = 0; q < kLaneCache; ++q) consider(cached.c[q]);
  for (int i = threadIdx.x % warpSize + kLaneCache * warpSize; i < n; i += warpSize) {
    consider(list_entry(values, indices, idx_base, i));
  }
  for (int offset = warpSize / 2; offset > 0; offset /= 2) {
    Candidate other;
    other.score = __shfl_xor_sync(kFullWarpMask, mine.score, offset);
    other.index = __shfl_xor_sync(kFullWarpMask, mine.index, offset);
    mine = better_of(mine, other);
  }
  return mine;
}

// grid (ceil(K / warps), B): the corrected logits of request b's candidates for its valid parents,
// row_scores[b, p, c] = cand_base[c] + fc2_weight[id_c] . hidden[b, p] (+ fc2_bias[id_c]), -inf for
// an out-of-range id (whose row is never read). Each warp takes one candidate's fc2 row and runs
// it over the request's parents' hidden vectors, staged in shared memory a chunk at a time, so
// the product spreads over K / 8 blocks per request and each fc2 row is read once per request.
template <typename Elem>
__global__ void expand_logits_kernel(TypedHeadWeightPtrs<Elem> head, ExpandInputs in, const float* hidden,
                                     float* cand_scores) {
  DARTREE_DYNAMIC_SHARED(float, s_x);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int b = blockIdx.y, k = in.k, e = head.e;
  int parents_here = in.num_parents[b];
  parents_here = parents_here < 0 ? 0 : (parents_here > in.p_max ? in.p_max : parents_here);
  const int c = blockIdx.x * warps + warp;  // this warp's candidate
  const int64_t id = c < k ? in.cand_ids[b * in.cand_stride + c] : -1;
  const bool valid = id >= 0 && id < head.v;
  const Elem* const f_row[1] = {valid ? head.fc2_weight + id * e : nullptr};
  float offset = kNegInf;  // cand_base + bias, or -inf for an out-of-range id
  if (valid) {
    offset = to_float(static_cast<const Elem*>(in.cand_base)[b * in.cand_stride + c]) +
             (head.fc2_bias != nullptr ? to_float(head.fc2_bias[id]) : 0.0f);
  }
  const float* h_rows = hidden + static_cast<int64_t>(b) * in.p_max * e;
  float* row_scores = cand_scores + static_cast<int64_t>(b) * in.p_max * k;
  const int chunk = stage_rows(e);
  for (int row0 = 0; row0 < parents_here; row0 += chunk) {
    const int n = parents_here - row0 < chunk ? parents_here - row0 : chunk;
    __syncthreads();
    stage_activations(h_rows, parents_here, e, row0, n, s_x);
    __syncthreads();
    float acc[kRowsPerChunk][1];
    lane_partial_dots(f_row, s_x, n, e, acc);
    float mine[1];  // lane r: parent row0 + r's dot product
    row_sums_by_lane(acc, n, mine);
    if (lane < n && c < k) row_scores[static_cast<int64_t>(row0 + lane) * k + c] = valid ? mine[0] + offset : kNegInf;
  }
}

// grid (B). For request b, from expand_logits' corrected logits: cand_scores[b, p, k] =
// parent_scores[b, p] + depth_bonus + log q(k | p) for its valid parents (the log-softmax over K,
// a warp per parent), then the top-W children (best first, ties to the lower p * K + k): each warp
// takes the top W of its slice (each lane's first entries held in registers over the W rounds),
// warp 0 merges them. Each child's parent state is copied to child_h[b, w] for expand_update, and
// the next depth's parent count written.
template <typename Elem>
__global__ void expand_select_kernel(TypedHeadWeightPtrs<Elem> head, ExpandInputs in, float* cand_scores,
                                     float* child_h, ExpandOutputs out) {
  DARTREE_DYNAMIC_SHARED(float, s_top);  // [warps + 1][W] scores, then [warps + 1][W] indices
  const int b = blockIdx.x, k = in.k, g = head.g, width = in.width;
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  int parents_here = in.num_parents[b];
  parents_here = parents_here < 0 ? 0 : (parents_here > in.p_max ? in.p_max : parents_here);
  int* s_top_idx = reinterpret_cast<int*>(s_top + (warps + 1) * width);
  float* row_scores = cand_scores + static_cast<int64_t>(b) * in.p_max * k;
  const int64_t* ids = in.cand_ids + b * in.cand_stride;
  const int count = parents_here * k;
  __syncthreads();
  for (int p = warp; p < parents_here; p += warps) {  // log-softmax over K, a warp per parent
    float* logits = row_scores + p * k;
    float v[kLaneCache];  // this lane's first logits (c = lane, lane + 32, ...), loaded together
DARTREE_UNROLL
    for (int q = 0; q < kLaneCache; ++q) v[q] = lane + q * warpSize < k ? logits[lane + q * warpSize] : kNegInf;
    const int rest = lane + kLaneCache * warpSize;  // K > 128: the rest in memory
    float m = kNegInf;
DARTREE_UNROLL
    for (int q = 0; q < kLaneCache; ++q) m = v[q] > m ? v[q] : m;
    for (int c = rest; c < k; c += warpSize) m = logits[c] > m ? logits[c] : m;
    m = warp_max(m);
    float sum = 0.0f;
DARTREE_UNROLL
    for (int q = 0; q < kLaneCache; ++q) {
      if (lane + q * warpSize < k) sum += expf(v[q] - m);
    }
    for (int c = rest; c < k; c += warpSize) sum += expf(logits[c] - m);
    sum = warp_sum(sum);
    const float offset = in.parent_scores[b * in.parent_score_stride + p] + in.depth_bonus - (m + logf(sum));
    __syncwarp();
DARTREE_UNROLL
    for (int q = 0; q < kLaneCache; ++q) {
      if (lane + q * warpSize < k) logits[lane + q * warpSize] = v[q] + offset;
    }
    for (int c = rest; c < k; c += warpSize) logits[c] += offset;
  }
  __syncthreads();
  // each warp: the top W of its slice [lo, hi); then warp 0 merges the warps' lists
  const int per_warp = (count + warps - 1) / warps;
  const int lo = warp * per_warp < count ? warp * per_warp : count;
  const int hi = lo + per_warp < count ? lo + per_warp : count;
  Candidate previous{kPosInf, -1};
  const LaneCandidates slice = lane_candidates(row_scores + lo, nullptr, hi - lo, lo);
  for (int w = 0; w < width; ++w) {
    const Candidate next = previous.index == kNoCandidate ? previous
                                                          : warp_next_best(slice, row_scores + lo, nullptr, hi - lo, lo, previous);
    if (lane == 0) {
      s_top[warp * width + w] = next.score;
      s_top_idx[warp * width + w] = next.index;
    }
    previous = next;
  }
  __syncthreads();
  if (warp == 0) {
    previous = Candidate{kPosInf, -1};
    const LaneCandidates lists = lane_candidates(s_top, s_top_idx, warps * width, 0);
    for (int w = 0; w < width; ++w) {
      const Candidate next = previous.index == kNoCandidate ? previous
                                                            : warp_next_best(lists, s_top, s_top_idx, warps * width, 0, previous);
      if (lane == 0) {
        s_top[warps * width + w] = next.score;
        s_top_idx[warps * width + w] = next.index;
      }
      previous = next;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) out.num_children[b] = count < width ? count : width;
  for (int w = warp; w < width; w += warps) {  // a warp per child: outputs and the parent-state copy
    const int64_t slot = static_cast<int64_t>(b) * out.stride + w;
    const int index = s_top_idx[warps * width + w];
    if (index == kNoCandidate) {  // fewer than w + 1 children exist: padding
      if (lane == 0) {
        out.parent_idx[slot] = -1;
        if (out.child_k != nullptr) out.child_k[slot] = -1;
        out.scores[slot] = kNegInf;
        out.tokens[slot] = 0;
        if (out.depths != nullptr) out.depths[slot] = -1;
      }
      continue;
    }
    const int p = index / k, c = index % k;
    if (lane == 0) {
      out.parent_idx[slot] = p + out.parent_offset;
      if (out.child_k != nullptr) out.child_k[slot] = c;
      out.scores[slot] = s_top[warps * width + w];
      out.tokens[slot] = ids[c];
      if (out.depths != nullptr) out.depths[slot] = out.depth_value;
    }
    if (child_h != nullptr) {
      const float* h = in.parent_states + (static_cast<int64_t>(b) * in.p_max + p) * g;
      float* h_out = child_h + (static_cast<int64_t>(b) * width + w) * g;
      batched_copy(lane, warpSize, g, [&](int j) { return h[j]; }, [&](int j, float x) { h_out[j] = x; });
    }
  }
}

// grid (ceil(G / warps), ceil(B x W / rows_per_block)): for child r = b * W + w, gh = w_hh h +
// b_hh (h = child_h[r], its parent's state), r = s(gi_r + gh_r), u = s(gi_z + gh_z),
// n = tanh(gi_n + r gh_n), h' = (1 - u) n + u h, where gi = gru_table[token] (token embedding x
// W_ih^T + b_ih, precomputed). Each warp reads the 3 rows of w_hh of one state element once per
// staged chunk of children; padding children get a zero state.
template <typename Elem>
__global__ void expand_update_kernel(TypedHeadWeightPtrs<Elem> head, ExpandInputs in, const float* child_h,
                                     ExpandOutputs out, int rows_per_block) {
  DARTREE_DYNAMIC_SHARED(float, s_x);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int g = head.g;
  const int64_t rows = static_cast<int64_t>(in.batch) * in.width;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  const int chunk = stage_rows(g);
  const int j = blockIdx.x * warps + warp;  // this warp's state element: rows j, G + j, 2G + j of w_hh
  const Elem* const w_rows[3] = {j < g ? head.w_hh + static_cast<int64_t>(j) * g : nullptr,
                                 j < g ? head.w_hh + static_cast<int64_t>(g + j) * g : nullptr,
                                 j < g ? head.w_hh + static_cast<int64_t>(2 * g + j) * g : nullptr};
  for (int64_t row0 = first; row0 < last; row0 += chunk) {
    const int n = static_cast<int>(last - row0 < chunk ? last - row0 : chunk);
    __syncthreads();
    stage_activations(child_h, rows, g, row0, n, s_x);
    __syncthreads();
    float acc[kRowsPerChunk][3];
    lane_partial_dots(w_rows, s_x, n, g, acc);
    float gh[3];  // lane r: child row0 + r's w_hh h (r, z, n gates)
    row_sums_by_lane(acc, n, gh);
    float gh_r = gh[0], gh_z = gh[1], gh_n = gh[2];
    if (lane < n && j < g) {
      const int r = lane;
      const int64_t row = row0 + r;
      const int b = static_cast<int>(row / in.width), w = static_cast<int>(row % in.width);
      const bool child = w < out.num_children[b];  // the select kernel's count (parent_idx can be -1: the root)
      const int64_t token = out.tokens[static_cast<int64_t>(b) * out.stride + w];
      // a -inf child with an out-of-range token (every candidate was out of range) reads no table row
      const bool in_vocab = child && token >= 0 && token < head.v;
      const Elem* gi = head.gru_table + (in_vocab ? token : 0) * 3 * g;
      float state = 0.0f;
      if (child) {
        if (head.b_hh != nullptr) {
          gh_r += to_float(head.b_hh[j]);
          gh_z += to_float(head.b_hh[g + j]);
          gh_n += to_float(head.b_hh[2 * g + j]);
        }
        const float gi_r = in_vocab ? to_float(gi[j]) : 0.0f, gi_z = in_vocab ? to_float(gi[g + j]) : 0.0f;
        const float gi_n = in_vocab ? to_float(gi[2 * g + j]) : 0.0f;
        const float rr = sigmoid(gi_r + gh_r);
        const float u = sigmoid(gi_z + gh_z);
        const float nn = tanhf(gi_n + rr * gh_n);
        state = (1.0f - u) * nn + u * s_x[r * g + j];
      }
      out.child_states[(static_cast<int64_t>(b) * in.width + w) * g + j] = state;
    }
  }
}

template <typename Elem>
void launch_expand_depth_as(const HeadWeightPtrs& weights, const ExpandInputs& in, float* workspace,
                            const ExpandOutputs& out, cudaStream_t stream) {
  const TypedHeadWeightPtrs<Elem> head{static_cast<const Elem*>(weights.w_s),
                                       static_cast<const Elem*>(weights.fc2_weight),
                                       static_cast<const Elem*>(weights.fc2_bias),
                                       static_cast<const Elem*>(weights.gru_table),
                                       static_cast<const Elem*>(weights.w_hh),
                                       static_cast<const Elem*>(weights.b_hh),
                                       weights.e,
                                       weights.g,
                                       weights.v};
  const int warps = kExpandThreads / 32;
  float* cand_scores = workspace;
  float* hidden = cand_scores + static_cast<int64_t>(in.batch) * in.p_max * in.k;
  float* child_h = hidden + static_cast<int64_t>(in.batch) * in.p_max * head.e;
  const size_t staged = sizeof(float) * static_cast<size_t>(stage_rows(head.g)) * head.g;
  if (in.width == 0) return;  // no children: nothing to score
  if (in.p_max > 0) {
    // a block per staged chunk of parents: every chunk re-reads its w_s rows (from L2), which buys
    // one block per 16 parents x 8 rows of w_s of parallelism
    const int64_t rows = static_cast<int64_t>(in.batch) * in.p_max;
    const int rows_per_block = stage_rows(head.g);
    const unsigned col_blocks = static_cast<unsigned>((head.e + warps - 1) / warps);  // a warp per row of w_s
    auto hidden_kernel = expand_hidden_kernel<Elem>;
    DARTREE_LAUNCH(hidden_kernel, dim3(col_blocks, static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block)),
                   dim3(kExpandThreads), staged, stream, head, in, hidden, rows_per_block);
    // a warp per candidate, K / 8 blocks per request
    auto logits_kernel = expand_logits_kernel<Elem>;
    const size_t staged_e = sizeof(float) * static_cast<size_t>(stage_rows(head.e)) * head.e;
    DARTREE_LAUNCH(logits_kernel, dim3(static_cast<unsigned>((in.k + warps - 1) / warps), static_cast<unsigned>(in.batch)),
                   dim3(kExpandThreads), staged_e, stream, head, in, hidden, cand_scores);
  }
  {
    const bool update = out.child_states != nullptr;  // null: the last depth, whose children are never expanded
    auto select_kernel = expand_select_kernel<Elem>;
    const size_t select_shared = sizeof(float) * static_cast<size_t>(expand_select_shared_floats(in.width));
    DARTREE_LAUNCH(select_kernel, dim3(static_cast<unsigned>(in.batch)), dim3(kExpandThreads), select_shared, stream, head,
                   in, cand_scores, update ? child_h : nullptr, out);
    if (update) {
      const int64_t rows = static_cast<int64_t>(in.batch) * in.width;
      const int rows_per_block = stage_rows(head.g);
      const unsigned col_blocks = static_cast<unsigned>((head.g + warps - 1) / warps);  // a warp per state element
      auto update_kernel = expand_update_kernel<Elem>;
      DARTREE_LAUNCH(update_kernel, dim3(col_blocks, static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block)),
                     dim3(kExpandThreads), staged, stream, head, in, child_h, out, rows_per_block);
    }
  }
}

void launch_expand_depth(const HeadWeightPtrs& head, const ExpandInputs& in, float* workspace, const ExpandOutputs& out,
                         cudaStream_t stream) {
  if (in.batch == 0) return;
  switch (head.dtype) {
    case ElemType::kBFloat16: launch_expand_depth_as<Bf16>(head, in, workspace, out, stream); break;
    case ElemType::kFloat16: launch_expand_depth_as<Fp16>(head, in, workspace, out, stream); break;
    default: launch_expand_depth_as<float>(head, in, workspace, out, stream);
  }
}

void launch_build_supertree(const HeadWeightPtrs& head, const SupertreeArgs& args, cudaStream_t stream) {
  const int64_t elem = head.dtype == ElemType::kFloat32 ? 4 : 2;
  int64_t total = 0;
  for (int d = 0; d < args.depth; ++d) total += args.widths[d];
  int64_t offset = 0, parent_offset = -1, p_max = 1;
  for (int d = 0; d < args.depth; ++d) {
    const int now = d % 2, next = 1 - now;
    const int64_t width = args.widths[d];
    const ExpandInputs in{static_cast<const char*>(args.z) + d * head.e * elem,
                          static_cast<int64_t>(args.depth) * head.e,
                          args.cand_ids + static_cast<int64_t>(d) * args.k,
                          static_cast<const char*>(args.cand_base) + static_cast<int64_t>(d) * args.k * elem,
                          static_cast<int64_t>(args.depth) * args.k,
                          args.states[now],
                          d == 0 ? args.root_scores : args.scores + parent_offset,
                          d == 0 ? 1 : total,
                          args.counts[now],
                          args.batch,
                          static_cast<int>(p_max),
                          args.k,
                          static_cast<int>(width),
                          args.depth_bonus};
    // the last depth's children are never expanded: no GRU update for them
    const ExpandOutputs out{args.parents + offset, nullptr, args.scores + offset, args.tokens + offset,
                            args.depths + offset,  total,   static_cast<int>(parent_offset), d + 1,
                            d + 1 < args.depth ? args.states[next] : nullptr, args.counts[next]};
    launch_expand_depth(head, in, args.workspace, out, stream);
    parent_offset = offset;
    offset += width;
    p_max = width;
  }
}

}  // namespace kernels
}  // namespace dartree
