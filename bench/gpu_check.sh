#!/usr/bin/env bash
# On a GPU machine (torch with CUDA and nvcc present, no package registry needed): build in place
# for the local GPU's arch, run the whole test suite (CPU, emulated and real CUDA backends), and
# print the op benchmark table. Fits in 8 minutes on a 16-core H200 host.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')")
  export TORCH_CUDA_ARCH_LIST
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== build (archs $TORCH_CUDA_ARCH_LIST)"
DARTREE_FORCE_CUDA=1 DARTREE_PTXAS_VERBOSE=1 python setup.py build_ext --inplace > gpu_build.log 2>&1 \
  || { tail -50 gpu_build.log; exit 1; }
grep -E "spill (stores|loads)" gpu_build.log | sort | uniq -c
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import dartree_ext, torch; print(dartree_ext.build_info()); assert torch.cuda.is_available()"
echo "== tests"
python -m pytest python_tests -q -x
echo "== benchmarks"
python bench/ops.py --batch 1 8 32
python bench/tree.py --device cuda --seq-heap-batch 1
python bench/vat.py --device cuda --reps 5
python bench/vat.py --device cuda --reps 5 --dtype bfloat16
