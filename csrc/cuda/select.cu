// The select kernels and their launchers for nvcc. Device code only: no torch headers here, so
// each GPU arch compiles in seconds; the torch-facing ops are in select_ops.cpp.
#include "../kernels/select.cuh"
