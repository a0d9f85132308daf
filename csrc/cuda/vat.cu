// The VAT-loss kernels and their launchers for nvcc. Device code only: no torch headers here; the
// torch-facing ops are in vat_ops.cpp.
#include "../kernels/vat.cuh"
