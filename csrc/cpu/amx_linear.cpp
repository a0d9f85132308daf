// amx_linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in bfloat16 through Intel AMX tiles, for the few
// rows of a decoding step or a tree verification (1 to 256).
//
// W is packed once (dartree_ext.linear.pack_amx) into the B-operand layout of TDPBF16PS:
// packed[nb][kb] is a 16 x 64-byte tile whose row r holds, for the 16 outputs nb * 16 + c, the
// input pair (kb * 32 + 2r, kb * 32 + 2r + 1): element (r, c, e) = W[nb * 16 + c][kb * 32 + 2r + e]
// (outputs past N are zero). An A tile is 16 rows of x, 32 inputs each, read in place.
//
// Arithmetic: every output element is one float32 accumulator, zeroed, then one TDPBF16PS per 32
// inputs in index order (each bfloat16 product is exact in float32; the instruction adds the
// pairs into the accumulator as the hardware defines), then the bias (float32) added and the sum
// rounded to bfloat16 once. The tile instruction computes each element of C from its own row of A
// and column of B, the same way wherever the row sits in the tile and however many rows the tile
// has, so the op is batch-invariant: row m of the result is bit-identical to the result for x[m]
// alone (tested for every row count and position), and a tree verification rounds as a plain step.
// Its bits differ from few_rows_linear's (another summation order), so a model runs one or the
// other for all its small forwards.
//
// Tiling: for each 32 rows of x, the threads split the output blocks; up to 16 rows, each thread runs
// 4 output blocks at once (4 C tiles, the A tile loaded once for the 4 B tiles), 17 to 32 rows 2
// output blocks for both 16-row halves (each B tile loaded once for the 2 A tiles), so the weights
// stream through once per 32 rows of x. Linux grants the process the tile state on first use
// (arch_prctl(ARCH_REQ_XCOMP_PERM)); without AMX, or without that grant, the op refuses to run
// (build_info()["amx_linear"] says which).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__CUDACC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DARTREE_AMX 1
#endif

namespace dartree {
namespace {

constexpr int64_t kMaxRows = 256;  // as few_rows_linear: more rows take a GEMM
constexpr int64_t kTileRows = 16, kTileInputs = 32, kTileOutputs = 16, kTileElems = 512;

#ifdef DARTREE_AMX

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1) && (d >> 22 & 1);  // AMX-TILE, AMX-BF16
}

// The tile state (XTILEDATA, feature 18) granted to this process: once, for every thread.
bool amx_granted() {
  static const bool granted = cpu_has_amx_bf16() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

struct Problem {
  const c10::BFloat16* x;   // [rows, in]
  const c10::BFloat16* w;   // packed: [out blocks, in / 32, 512]
  const float* bias;        // [out] or nullptr
  c10::BFloat16* y;         // [rows, out]
  int64_t rows, in, out;
};

inline void store_block(const Problem& p, const float* c, int64_t m0, int64_t mr, int64_t nb) {
  const int64_t n0 = nb * kTileOutputs, count = std::min<int64_t>(kTileOutputs, p.out - n0);
  for (int64_t r = 0; r < mr; ++r) {
    c10::BFloat16* y = p.y + (m0 + r) * p.out + n0;
    for (int64_t j = 0; j < count; ++j)
      y[j] = static_cast<c10::BFloat16>(p.bias != nullptr ? c[r * kTileOutputs + j] + p.bias[n0 + j] : c[r * kTileOutputs + j]);
  }
}

// The tile configuration: tile t has rows[t] rows of 64 bytes.
__attribute__((target("amx-tile"))) void load_config(const std::array<uint8_t, 8>& rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = rows[t];
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One output block nb for x rows m0 .. m0 + mr: C tile 0 from A tile 4 (the first 16 rows, or all
// mr), and with kTwoHalves C tile 2 from A tile 5 (rows m0 + 16 ..); B tile 6. Both tile_range
// configurations give these tiles those shapes.
template <bool kTwoHalves>
__attribute__((target("amx-tile,amx-bf16"))) void one_block(const Problem& p, int64_t m0, int64_t mr, int64_t nb) {
  const int64_t kb_count = p.in / kTileInputs;
  const c10::BFloat16* xa = p.x + m0 * p.in;
  const c10::BFloat16* xb = xa + kTileRows * p.in;
  const long x_stride = static_cast<long>(p.in * 2);
  const c10::BFloat16* w0 = p.w + nb * kb_count * kTileElems;
  alignas(64) float c[2][kTileRows * kTileOutputs];
  _tile_zero(0);
  if constexpr (kTwoHalves) _tile_zero(2);
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(4, xa + kb * kTileInputs, x_stride);
    _tile_loadd(6, w0 + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoHalves) {
      _tile_loadd(5, xb + kb * kTileInputs, x_stride);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, c[0], 64);
  store_block(p, c[0], m0, kTwoHalves ? kTileRows : mr, nb);
  if constexpr (kTwoHalves) {
    _tile_stored(2, c[1], 64);
    store_block(p, c[1], m0 + kTileRows, mr - kTileRows, nb);
  }
}

// Output blocks [nb_begin, nb_end) for x rows m0 .. m0 + mr: C tiles 0-3, A tile 4, B tiles 5-7.
__attribute__((target("amx-tile,amx-bf16"))) void tile_range(const Problem& p, int64_t m0, int64_t mr,
                                                            int64_t nb_begin, int64_t nb_end) {
  const uint8_t m = static_cast<uint8_t>(mr);
  load_config({m, m, m, m, m, 16, 16, 16});
  const int64_t kb_count = p.in / kTileInputs, block = kb_count * kTileElems;
  const c10::BFloat16* xa = p.x + m0 * p.in;
  const long x_stride = static_cast<long>(p.in * 2);
  alignas(64) float c[4][kTileRows * kTileOutputs];
  int64_t nb = nb_begin;
  for (; nb + 4 <= nb_end; nb += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const c10::BFloat16* w0 = p.w + nb * block;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const c10::BFloat16* wk = w0 + kb * kTileElems;
      _tile_loadd(4, xa + kb * kTileInputs, x_stride);
      _tile_loadd(5, wk, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, wk + block, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, wk + 2 * block, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, wk + 3 * block, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int t = 0; t < 4; ++t) store_block(p, c[t], m0, mr, nb + t);
  }
  for (; nb < nb_end; ++nb) one_block<false>(p, m0, mr, nb);
  _tile_release();
}

// Output blocks [nb_begin, nb_end) for x rows m0 .. m0 + mr, 16 < mr <= 32: two output blocks at once
// for both 16-row halves (C tiles 0-1: rows m0..m0+15, 2-3: the rest; A tiles 4-5, B tiles 6-7), so
// each weight tile is read once for the 32 rows.
__attribute__((target("amx-tile,amx-bf16"))) void tile_range_32(const Problem& p, int64_t m0, int64_t mr,
                                                               int64_t nb_begin, int64_t nb_end) {
  const uint8_t second = static_cast<uint8_t>(mr - kTileRows);
  load_config({16, 16, second, second, 16, second, 16, 16});
  const int64_t kb_count = p.in / kTileInputs, block = kb_count * kTileElems;
  const c10::BFloat16* xa = p.x + m0 * p.in;
  const c10::BFloat16* xb = xa + kTileRows * p.in;
  const long x_stride = static_cast<long>(p.in * 2);
  alignas(64) float c[4][kTileRows * kTileOutputs];
  int64_t nb = nb_begin;
  for (; nb + 2 <= nb_end; nb += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const c10::BFloat16* w0 = p.w + nb * block;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const c10::BFloat16* wk = w0 + kb * kTileElems;
      _tile_loadd(4, xa + kb * kTileInputs, x_stride);
      _tile_loadd(6, wk, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, xb + kb * kTileInputs, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, wk + block, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    store_block(p, c[0], m0, kTileRows, nb);
    store_block(p, c[1], m0, kTileRows, nb + 1);
    store_block(p, c[2], m0 + kTileRows, second, nb);
    store_block(p, c[3], m0 + kTileRows, second, nb + 1);
  }
  for (; nb < nb_end; ++nb) one_block<true>(p, m0, mr, nb);
  _tile_release();
}

void run(const Problem& p) {
  const int64_t blocks = (p.out + kTileOutputs - 1) / kTileOutputs;
  for (int64_t m0 = 0; m0 < p.rows; m0 += 2 * kTileRows) {
    const int64_t mr = std::min<int64_t>(2 * kTileRows, p.rows - m0);
    // chunks of whole 4-block groups (the grain), so a thread's range runs its C tiles at once
    at::parallel_for(0, (blocks + 3) / 4, 8, [&](int64_t begin, int64_t end) {
      const int64_t nb_begin = begin * 4, nb_end = std::min<int64_t>(end * 4, blocks);
      if (mr > kTileRows) {
        tile_range_32(p, m0, mr, nb_begin, nb_end);
      } else {
        tile_range(p, m0, mr, nb_begin, nb_end);
      }
    });
  }
}

#else

bool amx_granted() { return false; }

#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "amx_linear";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, op, ": packed must be bfloat16 (pack_amx), got ",
              packed.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": x and packed must be CPU tensors");
  const int64_t in = x.size(-1);
  TORCH_CHECK_VALUE(in > 0 && in % kTileInputs == 0, op, ": x has ", in, " features, a positive multiple of ",
                    kTileInputs, " expected");
  TORCH_CHECK_VALUE(out_features > 0, op, ": out_features must be positive, got ", out_features);
  const int64_t blocks = (out_features + kTileOutputs - 1) / kTileOutputs;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == blocks && packed.size(1) == in / kTileInputs &&
                  packed.size(2) == kTileElems && packed.is_contiguous(),
              op, ": packed must be a contiguous [", blocks, ", ", in / kTileInputs, ", ", kTileElems,
              "] tensor for ", out_features, " outputs of ", in, " features (pack_amx), got ", packed.sizes());
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  TORCH_CHECK_VALUE(rows <= kMaxRows, op, ": x has ", rows, " rows, at most ", kMaxRows,
                    " (use torch.nn.functional.linear)");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16, op, ": bias must be bfloat16 like x, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op, ": bias must have shape [", out_features,
                "], got ", bias->sizes());
    TORCH_CHECK(bias->device().is_cpu(), op, ": bias must be a CPU tensor");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  TORCH_CHECK(amx_granted(), op, ": this CPU (or build, or kernel) has no AMX-BF16 tiles for this process "
              "(build_info()['amx_linear'])");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  if (rows == 0) return y;
#ifdef DARTREE_AMX
  const at::Tensor flat = x.reshape({rows, in}).contiguous();
  run(Problem{flat.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(),
              bias32.defined() ? bias32.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>(), rows, in,
              out_features});
#endif
  return y;
}

}  // namespace

// "amx_bf16" where this process may run AMX-BF16 tiles, else "unavailable" (build_info()["amx_linear"]).
std::string amx_linear_path_name() { return amx_granted() ? "amx_bf16" : "unavailable"; }

TORCH_LIBRARY_IMPL(dartree_ext, CPU, m) { m.impl("amx_linear", &amx_linear); }

}  // namespace dartree
