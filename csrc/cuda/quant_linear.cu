// The quant_linear kernel and its launcher for nvcc. Device code only: no torch headers here; the
// torch-facing op is in quant_linear_ops.cpp.
#include "../kernels/quant_linear.cuh"
