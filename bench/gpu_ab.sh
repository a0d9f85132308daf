#!/usr/bin/env bash
# On a GPU machine: the same command under two builds of the extension, side by side in one run.
# The working tree is built in place; a copy of it whose csrc/ is BASE/csrc (another revision's
# kernels) is built in /tmp/dartree_ab_base, both for the local GPU's arch and in parallel. The
# command then runs under each build in turn (base first), ROUNDS times (default 2).
#
#   mkdir -p .ab_base && git archive <rev> csrc | tar -x -C .ab_base     # here, before the device call
#   bash bench/gpu_ab.sh .ab_base python bench/ops/expand_kernels.py --batch 1 8 64
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bench/gpu_ab.sh BASE_DIR COMMAND..." >&2; exit 2; }
BASE=$(cd "$1" && pwd); shift
[ -d "$BASE/csrc" ] || { echo "$BASE/csrc: no such directory" >&2; exit 2; }
cd "$(dirname "$0")/.."
HERE=$PWD
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')")
  export TORCH_CUDA_ARCH_LIST
fi
# the system g++, as bench/gpu_check.sh says why
if [ -x /usr/bin/g++ ] && [ -z "${DARTREE_KEEP_CXX:-}" ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
OTHER=/tmp/dartree_ab_base
rm -rf "$OTHER" && mkdir -p "$OTHER"
cp -r setup.py dartree_ext "$OTHER"/ && cp -r "$BASE/csrc" "$OTHER/csrc"
find "$OTHER/dartree_ext" -name "_C*.so" -delete
build() {  # dir log
  (cd "$1" && MAX_JOBS=$jobs DARTREE_FORCE_CUDA=1 DARTREE_PTXAS_VERBOSE=1 python setup.py build_ext --inplace > "$2" 2>&1) \
    || { tail -40 "$2"; echo "build failed: $1"; return 1; }
}
echo "== build both (archs $TORCH_CUDA_ARCH_LIST, $jobs jobs each)"
start=$(date +%s)
build "$HERE" "$HERE/gpu_build.log" & new_pid=$!
build "$OTHER" "$OTHER/gpu_build.log" & base_pid=$!
wait $new_pid && wait $base_pid
echo "built in $(( $(date +%s) - start )) s; ptxas spill reports (new, base):"
grep -hE "spill (stores|loads)" "$HERE/gpu_build.log" | sort | uniq -c
grep -hE "spill (stores|loads)" "$OTHER/gpu_build.log" | sort | uniq -c
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in base new; do
    dir=$([ $side = base ] && echo "$OTHER" || echo "$HERE")
    echo "== $side, round $round: $*"
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$@"
  done
done
