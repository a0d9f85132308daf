#!/bin/bash
# The main command (dartree-generate --compare-ar --compare-llama-cpp, plus ARGS) from two checkouts in
# turn, REPEATS times (default 4): one JSON summary a line, "tree" naming the checkout. A before / after
# figure that survives the machine's drift (pairs run minutes apart, not hours).
#   bash bench/e2e/checkouts_ab.sh /path/to/other/checkout bench/results/checkouts_ab.jsonl [ARGS...]
# The other checkout needs its extension built (or this one's _C*.so copied in, where csrc/ is the same).
here=$(cd "$(dirname "$0")/../.." && pwd)
other=$(cd "$1" && pwd); out=${2:-bench/results/checkouts_ab.jsonl}; shift 2
cd "$here"; : > "$out"
for rep in $(seq 1 ${REPEATS:-4}); do
  for tree in "$other" "$here"; do
    (cd "$tree" && PYTHONPATH=. python -c "
import sys, json, io, contextlib
from dartree_ext.cli import generate_main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    generate_main(['--compare-ar', '--compare-llama-cpp'] + sys.argv[1:])
s = buf.getvalue(); d = json.loads(s[s.index('{'):])
d['tree'] = '$tree'; print(json.dumps(d))
" "$@") >> "$out" 2>/dev/null
  done
done
