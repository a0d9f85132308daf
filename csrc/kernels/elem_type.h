// The element type a launcher is told its tensors have, shared by the expand launchers
// (launchers.h) and the VAT launchers (vat_launchers.h). The integer values are part of the
// interface: python_tests/emulated.py passes them to the emulated launchers.
#pragma once

namespace dartree {
namespace kernels {

// The expand launchers take the first three (the correction head's weights); the VAT launchers
// take all four (logits; their statistics, `Acc`, are float64 for kFloat64, float32 otherwise).
enum class ElemType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };

}  // namespace kernels
}  // namespace dartree
