// The KV compaction kernel and its launcher for nvcc. Device code only: no torch headers here, so
// each GPU arch compiles in seconds; the torch-facing op is in kv_ops.cpp.
#include "../kernels/kv.cuh"
