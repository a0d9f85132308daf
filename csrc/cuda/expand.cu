// The expand kernels and their launchers for nvcc. Device code only: no torch headers here, so
// each GPU arch compiles in seconds; the torch-facing ops are in expand_ops.cpp.
#include "../kernels/expand.cuh"
