#!/usr/bin/env bash
# Drafter training step time over the whole vocabulary against --draft-vocab N, in turn, on the
# first 64 training responses with cached target features (SmolLM2-135M target, the shipped
# drafter's recipe, continued from it). Two legs of 6 steps per variant, interleaved so the
# machine's drift touches both; prints the mean and median step time of each (the first step of
# each leg, which warms up, left out).
#
#   bash bench/analysis/train_step_time.sh            # VOCAB=4096 WORK=/tmp/train_step_time
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
VOCAB=${VOCAB:-4096}
WORK=${WORK:-/tmp/train_step_time}
mkdir -p "$WORK"
head -64 bench/data/smollm2_responses.jsonl > "$WORK/data.jsonl"
COMMON=(--target smollm2 --prompts shipped --num-prompts 64 --data "$WORK/data.jsonl" --cache-features --batch-size 8
        --blocks-per-sequence 8 --lr 3e-4 --warmup-steps 2 --loss vat --decay-gamma 2 --bf16 --dtype bfloat16
        --init dartree_ext/drafters/smollm2-135m-vat --log-every 1 --checkpoint-every 1000)
rm -rf "$WORK/full" "$WORK/dv"
for leg in 1 2; do
  $PYTHON -m dartree_ext.training.cli "${COMMON[@]}" --steps $((6 * leg)) --out "$WORK/full" > "$WORK/full.log" 2>&1
  $PYTHON -m dartree_ext.training.cli "${COMMON[@]}" --steps $((6 * leg)) --draft-vocab "$VOCAB" --out "$WORK/dv" \
    > "$WORK/dv.log" 2>&1
done
$PYTHON - "$WORK" <<'PY'
import json, statistics, sys
for name in ("full", "dv"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{name}/train_log.jsonl")]
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:]) if b["step"] != 7]  # 7: a new leg
    print(f"{name}: {len(steps)} steps, mean {statistics.mean(steps):.2f} s, median {statistics.median(steps):.2f} s")
PY
