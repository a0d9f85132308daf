#!/bin/bash
# The main command (dartree-generate --compare-ar --compare-llama-cpp) under five target set-ups, in turn, 3 times;
# one JSON summary a line (docs/results/llama_cpp_xeon.md). Needs llama-cpp-python. REPEATS=N and
# SETUPS="auto|--dtype float32 --linear gguf|..." (set-ups separated by |) change the defaults.
cd "$(dirname "$0")/../.."
out=${1:-bench/results/main_command_ab.jsonl}; : > $out
IFS='|' read -r -a setups <<< "${SETUPS:-auto|--dtype bfloat16 --linear amx|--dtype bfloat16 --linear few_rows|--dtype bfloat16 --linear gguf|--dtype bfloat16 --linear gguf_int8}"
for rep in $(seq 1 ${REPEATS:-3}); do
  for cfg in "${setups[@]}"; do
    args=$([ "$cfg" = auto ] && echo "" || echo "$cfg")
    PYTHONPATH=. python -c "
import sys, json, io, contextlib
from dartree_ext.cli import generate_main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    generate_main(['--compare-ar', '--compare-llama-cpp'] + sys.argv[1:])
s = buf.getvalue(); d = json.loads(s[s.index('{'):])
d['cfg'] = '$cfg'; print(json.dumps(d))
" $args >> $out 2>/dev/null
  done
done
