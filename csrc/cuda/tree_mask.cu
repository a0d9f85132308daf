// The tree_mask kernels and their launchers for nvcc. Device code only: no torch headers here, so
// each GPU arch compiles in seconds; the torch-facing ops are in tree_mask_ops.cpp.
#include "../kernels/tree_mask.cuh"
