#!/usr/bin/env bash
# Run every benchmark in bench/ and write its JSON under out/bench/. Each reports a ratio against a baseline
# measured in the same run (absolute times on shared 2-core machines are noise).
#   bash scripts/bench.sh            # all (about 20-30 minutes on 2 cores)
#   bash scripts/bench.sh simulate   # only the benchmarks whose name contains "simulate"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
OUT=out/bench
mkdir -p "$OUT"
only=${1:-}
run() {
  local name=$1; shift
  if [ -n "$only" ] && [[ "$name" != *"$only"* ]]; then return 0; fi
  echo "== bench: $name"
  "$PY" "$@"
}
run capture_overhead bench/capture_overhead.py --json "$OUT/capture_overhead.json"
run analyse_speed    bench/analyse_speed.py --json "$OUT/analyse_speed.json"
run simulate_speed   bench/simulate_speed.py --json "$OUT/simulate_speed.json"
run eplb_speed       bench/eplb_speed.py --json "$OUT/eplb_speed.json"
if [ -d ../shared/data/gpt-oss-20b ]; then
  run plan_compare   bench/plan_compare.py --out "$OUT/plan_compare"
else
  echo "== bench: plan_compare skipped (../shared/data/gpt-oss-20b absent)"
fi
run joint_speed      bench/joint_speed.py --json "$OUT/joint_speed.json"
run ep_layer         bench/ep_layer.py --json "$OUT/ep_layer.json"
echo "results in $OUT/"
