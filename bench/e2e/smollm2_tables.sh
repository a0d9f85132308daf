#!/usr/bin/env bash
# Every SmolLM2 figure in the README, in one go (CPU: about 45 min on 2 cores; run it alone, other
# busy processes slow torch's threads by orders of magnitude). Results go to bench/results/, figures
# to docs/figures/. Each step is a separate bench/e2e/e2e.py run; the tables are printed by that script.
#
#   bash bench/e2e/smollm2_tables.sh                       # the shipped drafter
#   DRAFTER=runs/x/drafter bash bench/e2e/smollm2_tables.sh
#   VAT=runs/smollm2_vat/drafter DFLASH=runs/smollm2_dflash/drafter bash bench/e2e/smollm2_tables.sh vat
#
# OUT=dir writes the results elsewhere (default bench/results); DEVICE=cpu|cuda picks the device.
# Steps (arguments; default: t0 t1 seqheap sweeps plots): t0, t1 (DARTree Table 1 at T = 0 / 1),
# seqheap (the sequential heap on a subset), vat (VAT Table 1: two drafters under chain and dartree),
# sweeps (tau vs W, B, beta; or one of them: sweep_width, sweep_budget, sweep_depth_bonus), plots.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRAFTER=${DRAFTER:-dartree_ext/drafters/smollm2-135m-vat}
SETS=gsm8k,humaneval,mtbench
OUT=${OUT:-bench/results}
DEV=${DEVICE:+--device $DEVICE}   # DEVICE=cuda runs on the GPU (default: cuda if present, else cpu)
E2E="$PY bench/e2e/e2e.py --target smollm2 --sets $SETS $DEV"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(t0 t1 seqheap sweeps plots)
for step in "${steps[@]}"; do
  echo "=== $step ($(date +%H:%M:%S))"
  case $step in
    t0) $E2E --drafter "$DRAFTER" --num-prompts "${T0_PROMPTS:-3}" --temperatures 0 --max-new-tokens 48 \
          --methods chain,chain_corrected,ddtree,dartree_fixed,dartree --json $OUT/e2e_smollm2_t0.json ;;
    t1) $E2E --drafter "$DRAFTER" --num-prompts "${T1_PROMPTS:-2}" --temperatures 1 --max-new-tokens 48 \
          --methods chain,chain_corrected,ddtree,dartree_fixed,dartree --json $OUT/e2e_smollm2_t1.json ;;
    seqheap) $PY bench/e2e/e2e.py --target smollm2 $DEV --sets gsm8k --drafter "$DRAFTER" --num-prompts 2 \
          --temperatures 0 --max-new-tokens 32 --methods dartree,seq_heap --json $OUT/e2e_smollm2_seqheap.json ;;
    vat) $E2E --drafter "vat=${VAT:?set VAT=dir},dflash=${DFLASH:?set DFLASH=dir}" --num-prompts "${VAT_PROMPTS:-3}" \
          --temperatures 0 --max-new-tokens 48 --methods chain,dartree --json $OUT/e2e_smollm2_vat_vs_dflash.json ;;
    sweeps|sweep_width|sweep_budget|sweep_depth_bonus)
      for sweep in width=4,8,12,16 budget=32,64,128 depth_bonus=-0.3,-0.2,-0.1,0; do
        name=${sweep%%=*}
        [ "$step" = sweeps ] || [ "$step" = "sweep_$name" ] || continue
        methods=dartree prompts=${SWEEP_PROMPTS:-3}
        [ "$name" = budget ] && methods=ddtree,dartree
        $E2E --drafter "$DRAFTER" --num-prompts "$prompts" --temperatures 0 --max-new-tokens 32 \
          --methods $methods --sweep "$sweep" --json $OUT/e2e_smollm2_sweep_$name.json
      done ;;
    plots) $PY bench/e2e/plots.py $OUT/e2e_smollm2_t0.json --out docs/figures \
          --sweeps $OUT/e2e_smollm2_sweep_width.json,$OUT/e2e_smollm2_sweep_budget.json,$OUT/e2e_smollm2_sweep_depth_bonus.json ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
