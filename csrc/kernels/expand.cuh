// Device code for DARTree's depth-wise tree expansion with a GRU correction head (DESIGN.md):
// for every active parent u of a depth, corrected logits of the K candidates
//   L[k] = cand_base[k] + fc2_weight[cand_ids[k]] . SiLU(z + w_s s(u)) (+ fc2_bias[cand_ids[k]]),
// log-softmax over the K candidates, child score = s(u) + log q + depth_bonus, the top-W children
// of the depth, and the GRU update of the kept children's states. Only the K candidate rows of
// fc2 are read: nothing of size V is touched per depth.
//
// Two kernels per depth: expand_scores (grid P x B: one block per parent) and
// expand_select_update (grid W x B: one block per kept child, each re-running the cheap top-W
// selection to find its child, then its GRU update). Weights and activations are float32,
// bfloat16 or float16 (read through `Elem`), accumulation, scores and states float32.
#pragma once

#include "block_ops.cuh"
#include "elem.cuh"

namespace dartree {
namespace kernels {

constexpr int kExpandThreads = 256;

DARTREE_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// y[r] = sum_c m[r, c] x[c] (+ bias[r]) for rows [0, rows): one warp per row, x in shared memory.
template <typename Elem>
DARTREE_DEVICE void warp_rows_matvec(const Elem* m, const Elem* bias, const float* x, int rows, int cols, float* y) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = blockDim.x / warpSize;
  for (int r = warp; r < rows; r += warps) {
    const Elem* row = m + static_cast<int64_t>(r) * cols;
    float acc = 0.0f;
    for (int c = lane; c < cols; c += warpSize) acc += to_float(row[c]) * x[c];
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc + (bias != nullptr ? to_float(bias[r]) : 0.0f);
  }
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

// grid (P, B). Writes cand_scores[b, p, k] = parent_scores[b, p] + log q(k | p) + depth_bonus for
// valid parents. Shared: state (G) + hidden (E) + logits (K) floats + 33 scratch.
template <typename Elem>
__global__ void expand_scores_kernel(HeadParams<Elem> head, ExpandInputs in, float* cand_scores) {
  DARTREE_DYNAMIC_SHARED(float, s_state);
  float* s_hidden = s_state + head.g;
  float* s_logit = s_hidden + head.e;
  float* s_scratch = s_logit + in.k;
  const int p = blockIdx.x, b = blockIdx.y, k = in.k;
  if (p >= in.num_parents[b]) return;  // uniform per block
  const int64_t parent = static_cast<int64_t>(b) * in.p_max + p;
  for (int j = threadIdx.x; j < head.g; j += blockDim.x) s_state[j] = in.parent_states[parent * head.g + j];
  __syncthreads();
  warp_rows_matvec(head.w_s, static_cast<const Elem*>(nullptr), s_state, head.e, head.g, s_hidden);
  __syncthreads();
  const Elem* z_row = static_cast<const Elem*>(in.z) + b * in.z_stride;
  for (int j = threadIdx.x; j < head.e; j += blockDim.x) {
    const float a = s_hidden[j] + to_float(z_row[j]);
    s_hidden[j] = a * sigmoid(a);  // SiLU
  }
  __syncthreads();
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, warps = blockDim.x / warpSize;
  const int64_t* ids = in.cand_ids + b * in.cand_stride;
  const Elem* base = static_cast<const Elem*>(in.cand_base) + b * in.cand_stride;
  for (int c = warp; c < k; c += warps) {
    const int64_t id = ids[c];
    if (id < 0 || id >= head.v) {  // uniform per warp: an out-of-range id reads nothing and scores -inf
      if (lane == 0) s_logit[c] = kNegInf;
      continue;
    }
    const Elem* row = head.fc2_weight + id * head.e;
    float acc = 0.0f;
    for (int j = lane; j < head.e; j += warpSize) acc += to_float(row[j]) * s_hidden[j];
    acc = warp_sum(acc);
    if (lane == 0)
      s_logit[c] = to_float(base[c]) + acc + (head.fc2_bias != nullptr ? to_float(head.fc2_bias[id]) : 0.0f);
  }
  __syncthreads();
  float local_max = kNegInf;
  for (int c = threadIdx.x; c < k; c += blockDim.x) local_max = s_logit[c] > local_max ? s_logit[c] : local_max;
  const float max_logit = block_reduce<true>(local_max, s_scratch);
  float local_sum = 0.0f;
  for (int c = threadIdx.x; c < k; c += blockDim.x) local_sum += expf(s_logit[c] - max_logit);
  const float log_norm = max_logit + logf(block_reduce<false>(local_sum, s_scratch));
  const float offset = in.parent_scores[b * in.parent_score_stride + p] + in.depth_bonus - log_norm;
  for (int c = threadIdx.x; c < k; c += blockDim.x) cand_scores[parent * k + c] = s_logit[c] + offset;
}

// grid (W, B). Block w finds the w-th best candidate (w + 1 rounds of the top-W selection), writes
// that child, and computes its GRU state: gh = w_hh h + b_hh, r = s(gi_r + gh_r),
// u = s(gi_z + gh_z), n = tanh(gi_n + r gh_n), h' = (1 - u) n + u h, where gi = gru_table[token]
// (token embedding x W_ih^T + b_ih, precomputed). Block 0 also writes the next depth's parent
// count. Shared: h (G) + gh (3G) floats. With `out.child_states` null (the last depth, whose
// children are never expanded) only the selection runs and no shared state is used.
template <typename Elem>
__global__ void expand_select_update_kernel(HeadParams<Elem> head, ExpandInputs in, const float* cand_scores,
                                            ExpandOutputs out) {
  DARTREE_DYNAMIC_SHARED(float, s_h);
  float* s_gh = s_h + head.g;
  DARTREE_SHARED_ARRAY(Candidate, s_best, 33);
  const int w = blockIdx.x, b = blockIdx.y, k = in.k;
  int parents_here = in.num_parents[b];
  parents_here = parents_here < 0 ? 0 : (parents_here > in.p_max ? in.p_max : parents_here);
  const int count = parents_here * k;
  const float* row_scores = cand_scores + static_cast<int64_t>(b) * in.p_max * k;
  if (w == 0 && threadIdx.x == 0) out.num_children[b] = count < in.width ? count : in.width;
  Candidate previous{kPosInf, -1};
  for (int round = 0; round <= w; ++round) {
    Candidate mine{kNegInf, kNoCandidate};
    for (int c = threadIdx.x; c < count; c += blockDim.x) {
      const float s = sanitize_score(row_scores[c]);
      if (better(previous.score, previous.index, s, c)) mine = better_of(mine, Candidate{s, c});
    }
    previous = block_best(mine, s_best);
    if (previous.index == kNoCandidate) break;
  }
  const int64_t slot = static_cast<int64_t>(b) * out.stride + w;
  float* state_out = out.child_states == nullptr ? nullptr
                                                 : out.child_states + (static_cast<int64_t>(b) * in.width + w) * head.g;
  if (previous.index == kNoCandidate) {  // fewer than w + 1 children exist: padding
    if (threadIdx.x == 0) {
      out.parent_idx[slot] = -1;
      if (out.child_k != nullptr) out.child_k[slot] = -1;
      out.scores[slot] = kNegInf;
      out.tokens[slot] = 0;
      if (out.depths != nullptr) out.depths[slot] = -1;
    }
    if (state_out != nullptr)
      for (int j = threadIdx.x; j < head.g; j += blockDim.x) state_out[j] = 0.0f;
    return;
  }
  const int p = previous.index / k, c = previous.index % k;
  const int64_t token = in.cand_ids[b * in.cand_stride + c];
  if (threadIdx.x == 0) {
    out.parent_idx[slot] = p + out.parent_offset;
    if (out.child_k != nullptr) out.child_k[slot] = c;
    out.scores[slot] = previous.score;
    out.tokens[slot] = token;
    if (out.depths != nullptr) out.depths[slot] = out.depth_value;
  }
  if (state_out == nullptr) return;  // uniform per launch
  const float* h = in.parent_states + (static_cast<int64_t>(b) * in.p_max + p) * head.g;
  for (int j = threadIdx.x; j < head.g; j += blockDim.x) s_h[j] = h[j];
  __syncthreads();
  warp_rows_matvec(head.w_hh, head.b_hh, s_h, 3 * head.g, head.g, s_gh);
  __syncthreads();
  // a -inf child with an out-of-range token (every candidate was out of range) reads no table row
  const bool in_vocab = token >= 0 && token < head.v;
  const Elem* gi = head.gru_table + (in_vocab ? token : 0) * 3 * head.g;
  for (int j = threadIdx.x; j < head.g; j += blockDim.x) {
    const float gi_r = in_vocab ? to_float(gi[j]) : 0.0f, gi_z = in_vocab ? to_float(gi[head.g + j]) : 0.0f;
    const float gi_n = in_vocab ? to_float(gi[2 * head.g + j]) : 0.0f;
    const float r = sigmoid(gi_r + s_gh[j]);
    const float u = sigmoid(gi_z + s_gh[head.g + j]);
    const float n = tanhf(gi_n + r * s_gh[2 * head.g + j]);
    state_out[j] = (1.0f - u) * n + u * s_h[j];
  }
}

template <typename Elem>
void launch_expand_depth_as(const ExpandHead& weights, const ExpandInputs& in, float* cand_scores,
                            const ExpandOutputs& out, cudaStream_t stream) {
  const HeadParams<Elem> head{static_cast<const Elem*>(weights.w_s),      static_cast<const Elem*>(weights.fc2_weight),
                              static_cast<const Elem*>(weights.fc2_bias), static_cast<const Elem*>(weights.gru_table),
                              static_cast<const Elem*>(weights.w_hh),     static_cast<const Elem*>(weights.b_hh),
                              weights.e,
                              weights.g,
                              weights.v};
  if (in.p_max > 0) {
    const size_t shared = sizeof(float) * (static_cast<size_t>(head.g) + head.e + in.k + 33);
    auto scores_kernel = expand_scores_kernel<Elem>;
    DARTREE_LAUNCH(scores_kernel, dim3(static_cast<unsigned>(in.p_max), static_cast<unsigned>(in.batch)),
                   dim3(kExpandThreads), shared, stream, head, in, cand_scores);
  }
  if (in.width > 0) {
    const size_t shared = out.child_states == nullptr ? 0 : sizeof(float) * 4 * static_cast<size_t>(head.g);
    auto update_kernel = expand_select_update_kernel<Elem>;
    DARTREE_LAUNCH(update_kernel, dim3(static_cast<unsigned>(in.width), static_cast<unsigned>(in.batch)),
                   dim3(kExpandThreads), shared, stream, head, in, cand_scores, out);
  }
}

void launch_expand_depth(const ExpandHead& head, const ExpandInputs& in, float* cand_scores, const ExpandOutputs& out,
                         cudaStream_t stream) {
  if (in.batch == 0) return;
  switch (head.dtype) {
    case ElemType::kBFloat16: launch_expand_depth_as<Bf16>(head, in, cand_scores, out, stream); break;
    case ElemType::kFloat16: launch_expand_depth_as<Fp16>(head, in, cand_scores, out, stream); break;
    default: launch_expand_depth_as<float>(head, in, cand_scores, out, stream);
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
    launch_expand_depth(head, in, args.cand_scores, out, stream);
    parent_offset = offset;
    offset += width;
    p_max = width;
  }
}

}  // namespace kernels
}  // namespace dartree
