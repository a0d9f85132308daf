#!/bin/bash
# The main command (dartree-generate: dartree, every set-up choice auto) against plain decoding on the set-up
# plain decoding picks for itself (dartree-generate --method ar: one-token forwards decide), in turn, N pairs;
# one JSON summary a line each, then each pair's ar time per token / dartree's (both include the prefill).
# The main command's own speedup_vs_ar is against plain decoding on the dartree set-up. Where the two
# set-ups differ (dtype, linear layers), so do their texts: each is its own set-up's plain decoding.
cd "$(dirname "$0")/../.."
out=${1:-bench/results/main_vs_fastest_ar.jsonl}; pairs=${2:-5}; : > $out
run() {
  PYTHONPATH=. python -c "
import sys, json, io, contextlib
from dartree_ext.cli import generate_main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    generate_main(sys.argv[1:])
s = buf.getvalue(); d = json.loads(s[s.index('{'):]); d['args'] = sys.argv[1:]; print(json.dumps(d))
" "$@" >> $out 2>/dev/null
}
for i in $(seq 1 $pairs); do run --compare-ar; run --method ar; done
python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
main, ar = rows[0::2], rows[1::2]
per = lambda d: d["wall_s"] / d["new_tokens"]  # noqa: E731
ratios = [per(a) / per(m) for m, a in zip(main, ar)]
print(f"main command: {main[0]['dtype']} + {main[0]['linear']}, tau {main[0]['tau']}; plain decoding alone: "
      f"{ar[0]['dtype']} + {ar[0]['linear']}")
print("ar (its own set-up) / dartree time per token, pairs:", [round(r, 3) for r in ratios],
      "median", round(statistics.median(ratios), 3))
print("ms per token, dartree:", [round(1e3 * per(m), 2) for m in main], "ar:", [round(1e3 * per(a), 2) for a in ar])
print("speedup_vs_ar (ar on the dartree set-up), runs:", [m["speedup_vs_ar"] for m in main],
      "same output as that ar:", all(m["same_output_as_ar"] for m in main))
PY
