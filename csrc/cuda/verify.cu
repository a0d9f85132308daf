// The verify kernels and their launchers for nvcc. Device code only: no torch headers here, so
// each GPU arch compiles in seconds; the torch-facing ops are in verify_ops.cpp.
#include "../kernels/verify.cuh"
