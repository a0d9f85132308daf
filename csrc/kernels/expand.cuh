// Device code for DARTree's depth-wise tree expansion with a GRU correction head (DESIGN.md):
// for every active parent u of a depth, corrected logits of the K candidates
//   L[k] = cand_base[k] + fc2_weight[cand_ids[k]] . SiLU(z + w_s s(u)) (+ fc2_bias[cand_ids[k]]),
// log-softmax over the K candidates, child score = s(u) + log q + depth_bonus, the top-W children
// of the depth, and the GRU update of the kept children's states. Only the K candidate rows of
// fc2 are read: nothing of size V is touched per depth.
//
// Three kernels per depth, each reading its weights once per launch (weight-stationary):
//   expand_hidden   grid (E / 32, row chunks): SiLU(z + w_s s(u)) for all B x P parents; each warp
//                   keeps 4 rows of w_s and runs them over the parents' states staged in shared memory.
//   expand_select   grid (B): per request, each candidate's fc2 row dotted with all P parents'
//                   hidden vectors (read once per request), the log-softmax over K per parent, the
//                   top-W children, and a copy of each child's parent state for the update.
//   expand_update   grid (G / 16, row chunks), not launched for the last depth: w_hh h for all
//                   B x W children, each warp keeping the r / z / n rows of 2 state elements, and
//                   the GRU gates in the epilogue.
// Weights and activations are float32, bfloat16 or float16 (read through `Elem`); accumulation,
// scores and states float32. Workspace: expand_workspace_floats() floats (launchers.h).
#pragma once

#include "block_ops.cuh"
#include "elem.cuh"

namespace dartree {
namespace kernels {

constexpr int kExpandThreads = 256;
constexpr int kRowsPerChunk = 16;       // activation rows staged in shared memory at a time (at most)
constexpr int kStageFloats = 8192;      // 32 KiB of staged activations
constexpr int kHiddenRowsPerWarp = 4;   // rows of w_s a warp keeps
constexpr int kUpdateColsPerWarp = 2;   // state elements (x 3 gate rows of w_hh) a warp keeps

DARTREE_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Rows of activations staged per chunk: as many as fit kStageFloats, at most kRowsPerChunk.
DARTREE_HOST_DEVICE int stage_rows(int cols) {
  const int rows = kStageFloats / (cols > 0 ? cols : 1);
  return rows < 1 ? 1 : (rows > kRowsPerChunk ? kRowsPerChunk : rows);
}

template <typename Elem>
struct HeadParams {  // ExpandHead with typed pointers
  const Elem* w_s;         // [E, G]
  const Elem* fc2_weight;  // [V, E]
  const Elem* fc2_bias;    // [V] or null
  const Elem* gru_table;   // [V, 3G]
  const Elem* w_hh;        // [3G, G]
  const Elem* b_hh;        // [3G] or null
  int e, g;
  int64_t v;
};

// Stage activation rows [row0, row0 + n) of x [rows, cols] (float32) in shared memory; rows past
// `rows` read as 0. All threads of the block call it.
DARTREE_DEVICE void stage_activations(const float* x, int64_t rows, int cols, int64_t row0, int n, float* s_x) {
  for (int i = threadIdx.x; i < n * cols; i += blockDim.x) {
    const int64_t r = row0 + i / cols;
    s_x[i] = r < rows ? x[r * cols + i % cols] : 0.0f;
  }
}

// grid (ceil(E / (warps x 4)), ceil(R / rows_per_block)), R = B x P: hidden[r, e] = SiLU(z[b(r), e]
// + sum_g w_s[e, g] states[r, g]). Each warp reads its 4 rows of w_s once per block and keeps
// per-lane partial sums for every staged parent row; one warp reduction per output.
template <typename Elem>
__global__ void expand_hidden_kernel(HeadParams<Elem> head, ExpandInputs in, float* hidden, int rows_per_block) {
  DARTREE_DYNAMIC_SHARED(float, s_x);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int g = head.g, e = head.e;
  const int64_t rows = static_cast<int64_t>(in.batch) * in.p_max;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  const int chunk = stage_rows(g);
  const int e0 = (blockIdx.x * warps + warp) * kHiddenRowsPerWarp;
  for (int64_t row0 = first; row0 < last; row0 += chunk) {
    const int n = static_cast<int>(last - row0 < chunk ? last - row0 : chunk);
    __syncthreads();
    stage_activations(in.parent_states, rows, g, row0, n, s_x);
    __syncthreads();
    float acc[kRowsPerChunk][kHiddenRowsPerWarp];
DARTREE_UNROLL
    for (int r = 0; r < kRowsPerChunk; ++r)
DARTREE_UNROLL
      for (int i = 0; i < kHiddenRowsPerWarp; ++i) acc[r][i] = 0.0f;
    for (int c = lane; c < g; c += warpSize) {
      float w[kHiddenRowsPerWarp];
DARTREE_UNROLL
      for (int i = 0; i < kHiddenRowsPerWarp; ++i)
        w[i] = e0 + i < e ? to_float(head.w_s[static_cast<int64_t>(e0 + i) * g + c]) : 0.0f;
DARTREE_UNROLL
      for (int r = 0; r < kRowsPerChunk; ++r) {
        if (r < n) {
          const float x = s_x[r * g + c];
DARTREE_UNROLL
          for (int i = 0; i < kHiddenRowsPerWarp; ++i) acc[r][i] += w[i] * x;
        }
      }
    }
DARTREE_UNROLL
    for (int r = 0; r < kRowsPerChunk; ++r) {
      if (r >= n) break;  // uniform per warp
      const int64_t row = row0 + r;
      const int b = static_cast<int>(row / in.p_max);
      const Elem* z_row = static_cast<const Elem*>(in.z) + b * in.z_stride;
DARTREE_UNROLL
      for (int i = 0; i < kHiddenRowsPerWarp; ++i) {
        const float v = warp_sum(acc[r][i]);
        if (lane == 0 && e0 + i < e) {
          const float a = v + to_float(z_row[e0 + i]);
          hidden[row * e + e0 + i] = a * sigmoid(a);  // SiLU
        }
      }
    }
  }
}

// grid (B). For request b: cand_scores[b, p, k] = parent_scores[b, p] + depth_bonus + log q(k | p)
// for its valid parents (each candidate's fc2 row is read once and dotted with every parent's
// hidden vector), then the top-W children (best first, ties to the lower p * K + k), each
// child's parent state copied to child_h[b, w] for expand_update, and the next depth's parent
// count.
template <typename Elem>
__global__ void expand_select_kernel(HeadParams<Elem> head, ExpandInputs in, float* cand_scores, const float* hidden,
                                     float* child_h, ExpandOutputs out) {
  DARTREE_SHARED_ARRAY(Candidate, s_best, 33);
  const int b = blockIdx.x, k = in.k, e = head.e, g = head.g;
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  int parents_here = in.num_parents[b];
  parents_here = parents_here < 0 ? 0 : (parents_here > in.p_max ? in.p_max : parents_here);
  float* row_scores = cand_scores + static_cast<int64_t>(b) * in.p_max * k;
  const float* h_rows = hidden + static_cast<int64_t>(b) * in.p_max * e;
  const int64_t* ids = in.cand_ids + b * in.cand_stride;
  const Elem* base = static_cast<const Elem*>(in.cand_base) + b * in.cand_stride;
  constexpr int kParentsPerPass = 8;
  for (int c = warp; c < k; c += warps) {  // corrected logits, a warp per candidate
    const int64_t id = ids[c];
    const bool valid = id >= 0 && id < head.v;  // uniform per warp: an out-of-range id reads nothing, scores -inf
    const Elem* row = head.fc2_weight + (valid ? id : 0) * e;
    const float extra = valid ? to_float(base[c]) + (head.fc2_bias != nullptr ? to_float(head.fc2_bias[id]) : 0.0f)
                              : 0.0f;
    for (int p0 = 0; p0 < parents_here; p0 += kParentsPerPass) {
      float acc[kParentsPerPass];
DARTREE_UNROLL
      for (int i = 0; i < kParentsPerPass; ++i) acc[i] = 0.0f;
      if (valid) {
        for (int j = lane; j < e; j += warpSize) {
          const float w = to_float(row[j]);
DARTREE_UNROLL
          for (int i = 0; i < kParentsPerPass; ++i)
            if (p0 + i < parents_here) acc[i] += w * h_rows[static_cast<int64_t>(p0 + i) * e + j];
        }
      }
DARTREE_UNROLL
      for (int i = 0; i < kParentsPerPass; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && p0 + i < parents_here) row_scores[(p0 + i) * k + c] = valid ? v + extra : kNegInf;
      }
    }
  }
  __syncthreads();
  for (int p = warp; p < parents_here; p += warps) {  // log-softmax over K, a warp per parent
    float* logits = row_scores + p * k;
    float m = kNegInf;
    for (int c = lane; c < k; c += warpSize) m = logits[c] > m ? logits[c] : m;
    m = warp_max(m);
    float sum = 0.0f;
    for (int c = lane; c < k; c += warpSize) sum += expf(logits[c] - m);
    sum = warp_sum(sum);
    const float offset = in.parent_scores[b * in.parent_score_stride + p] + in.depth_bonus - (m + logf(sum));
    __syncwarp();
    for (int c = lane; c < k; c += warpSize) logits[c] += offset;
  }
  __syncthreads();
  const int count = parents_here * k;
  if (threadIdx.x == 0) out.num_children[b] = count < in.width ? count : in.width;
  Candidate previous{kPosInf, -1};
  for (int w = 0; w < in.width; ++w) {  // the w-th best child
    const int64_t slot = static_cast<int64_t>(b) * out.stride + w;
    Candidate mine{kNegInf, kNoCandidate};
    if (previous.index != kNoCandidate)
      for (int c = threadIdx.x; c < count; c += blockDim.x) {
        const float s = sanitize_score(row_scores[c]);
        if (better(previous.score, previous.index, s, c)) mine = better_of(mine, Candidate{s, c});
      }
    previous = previous.index == kNoCandidate ? previous : block_best(mine, s_best);
    float* h_out = child_h == nullptr ? nullptr : child_h + (static_cast<int64_t>(b) * in.width + w) * g;
    if (previous.index == kNoCandidate) {  // fewer than w + 1 children exist: padding
      if (threadIdx.x == 0) {
        out.parent_idx[slot] = -1;
        if (out.child_k != nullptr) out.child_k[slot] = -1;
        out.scores[slot] = kNegInf;
        out.tokens[slot] = 0;
        if (out.depths != nullptr) out.depths[slot] = -1;
      }
      continue;
    }
    const int p = previous.index / k, c = previous.index % k;
    if (threadIdx.x == 0) {
      out.parent_idx[slot] = p + out.parent_offset;
      if (out.child_k != nullptr) out.child_k[slot] = c;
      out.scores[slot] = previous.score;
      out.tokens[slot] = ids[c];
      if (out.depths != nullptr) out.depths[slot] = out.depth_value;
    }
    if (h_out != nullptr) {
      const float* h = in.parent_states + (static_cast<int64_t>(b) * in.p_max + p) * g;
      for (int j = threadIdx.x; j < g; j += blockDim.x) h_out[j] = h[j];
    }
  }
}

// grid (ceil(G / (warps x 2)), ceil(B x W / rows_per_block)): for child r = b * W + w, gh = w_hh h +
// b_hh (h = child_h[r], its parent's state), r = s(gi_r + gh_r), u = s(gi_z + gh_z),
// n = tanh(gi_n + r gh_n), h' = (1 - u) n + u h, where gi = gru_table[token] (token embedding x
// W_ih^T + b_ih, precomputed). Each warp reads its rows of w_hh (3 per state element) once per
// block; padding children get a zero state.
template <typename Elem>
__global__ void expand_update_kernel(HeadParams<Elem> head, ExpandInputs in, const float* child_h, ExpandOutputs out,
                                     int rows_per_block) {
  DARTREE_DYNAMIC_SHARED(float, s_x);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int g = head.g;
  const int64_t rows = static_cast<int64_t>(in.batch) * in.width;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  const int chunk = stage_rows(g);
  const int j0 = (blockIdx.x * warps + warp) * kUpdateColsPerWarp;
  constexpr int kGateRows = 3 * kUpdateColsPerWarp;
  for (int64_t row0 = first; row0 < last; row0 += chunk) {
    const int n = static_cast<int>(last - row0 < chunk ? last - row0 : chunk);
    __syncthreads();
    stage_activations(child_h, rows, g, row0, n, s_x);
    __syncthreads();
    float acc[kRowsPerChunk][kGateRows];
DARTREE_UNROLL
    for (int r = 0; r < kRowsPerChunk; ++r)
DARTREE_UNROLL
      for (int i = 0; i < kGateRows; ++i) acc[r][i] = 0.0f;
    for (int c = lane; c < g; c += warpSize) {
      float w[kGateRows];  // gate q of element j0 + i: row q * G + j0 + i of w_hh
DARTREE_UNROLL
      for (int i = 0; i < kGateRows; ++i) {
        const int j = j0 + i % kUpdateColsPerWarp, q = i / kUpdateColsPerWarp;
        w[i] = j < g ? to_float(head.w_hh[(static_cast<int64_t>(q) * g + j) * g + c]) : 0.0f;
      }
DARTREE_UNROLL
      for (int r = 0; r < kRowsPerChunk; ++r) {
        if (r < n) {
          const float x = s_x[r * g + c];
DARTREE_UNROLL
          for (int i = 0; i < kGateRows; ++i) acc[r][i] += w[i] * x;
        }
      }
    }
DARTREE_UNROLL
    for (int r = 0; r < kRowsPerChunk; ++r) {
      if (r >= n) break;  // uniform per warp
      const int64_t row = row0 + r;
      const int b = static_cast<int>(row / in.width), w = static_cast<int>(row % in.width);
      const int64_t slot = static_cast<int64_t>(b) * out.stride + w;
      const bool child = w < out.num_children[b];  // the select kernel's count (parent_idx can be -1: the root)
      const int64_t token = out.tokens[slot];
      // a -inf child with an out-of-range token (every candidate was out of range) reads no table row
      const bool in_vocab = child && token >= 0 && token < head.v;
      const Elem* gi = head.gru_table + (in_vocab ? token : 0) * 3 * g;
      float gh[kGateRows];
DARTREE_UNROLL
      for (int i = 0; i < kGateRows; ++i) gh[i] = warp_sum(acc[r][i]);
      if (lane < kUpdateColsPerWarp) {
        const int j = j0 + lane;
        float gh_r = gh[0], gh_z = gh[kUpdateColsPerWarp], gh_n = gh[2 * kUpdateColsPerWarp];
DARTREE_UNROLL
        for (int i = 1; i < kUpdateColsPerWarp; ++i)
          if (lane == i) gh_r = gh[i], gh_z = gh[kUpdateColsPerWarp + i], gh_n = gh[2 * kUpdateColsPerWarp + i];
        if (j < g) {
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
  }
}

template <typename Elem>
void launch_expand_depth_as(const ExpandHead& weights, const ExpandInputs& in, float* workspace,
                            const ExpandOutputs& out, cudaStream_t stream) {
  const HeadParams<Elem> head{static_cast<const Elem*>(weights.w_s),      static_cast<const Elem*>(weights.fc2_weight),
                              static_cast<const Elem*>(weights.fc2_bias), static_cast<const Elem*>(weights.gru_table),
                              static_cast<const Elem*>(weights.w_hh),     static_cast<const Elem*>(weights.b_hh),
                              weights.e,
                              weights.g,
                              weights.v};
  const int warps = kExpandThreads / 32;
  float* cand_scores = workspace;
  float* hidden = cand_scores + static_cast<int64_t>(in.batch) * in.p_max * in.k;
  float* child_h = hidden + static_cast<int64_t>(in.batch) * in.p_max * head.e;
  const size_t staged = sizeof(float) * static_cast<size_t>(stage_rows(head.g)) * head.g;
  if (in.p_max > 0) {
    // every row block re-reads w_s: row blocks of 128 parents (B = 10 at P = 12) read it once for most batches
    const int64_t rows = static_cast<int64_t>(in.batch) * in.p_max;
    const int rows_per_block = 128;
    const unsigned col_blocks = static_cast<unsigned>((head.e + warps * kHiddenRowsPerWarp - 1) / (warps * kHiddenRowsPerWarp));
    auto hidden_kernel = expand_hidden_kernel<Elem>;
    DARTREE_LAUNCH(hidden_kernel, dim3(col_blocks, static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block)),
                   dim3(kExpandThreads), staged, stream, head, in, hidden, rows_per_block);
  }
  if (in.width > 0) {
    const bool update = out.child_states != nullptr;  // null: the last depth, whose children are never expanded
    auto select_kernel = expand_select_kernel<Elem>;
    DARTREE_LAUNCH(select_kernel, dim3(static_cast<unsigned>(in.batch)), dim3(kExpandThreads), 0, stream, head, in,
                   cand_scores, hidden, update ? child_h : nullptr, out);
    if (update) {
      const int64_t rows = static_cast<int64_t>(in.batch) * in.width;
      const int rows_per_block = 128;
      const unsigned col_blocks = static_cast<unsigned>((head.g + warps * kUpdateColsPerWarp - 1) / (warps * kUpdateColsPerWarp));
      auto update_kernel = expand_update_kernel<Elem>;
      DARTREE_LAUNCH(update_kernel, dim3(col_blocks, static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block)),
                     dim3(kExpandThreads), staged, stream, head, in, child_h, out, rows_per_block);
    }
  }
}

void launch_expand_depth(const ExpandHead& head, const ExpandInputs& in, float* workspace, const ExpandOutputs& out,
                         cudaStream_t stream) {
  if (in.batch == 0) return;
  switch (head.dtype) {
    case ElemType::kBFloat16: launch_expand_depth_as<Bf16>(head, in, workspace, out, stream); break;
    case ElemType::kFloat16: launch_expand_depth_as<Fp16>(head, in, workspace, out, stream); break;
    default: launch_expand_depth_as<float>(head, in, workspace, out, stream);
  }
}

void launch_build_supertree(const ExpandHead& head, const SupertreeArgs& args, cudaStream_t stream) {
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
