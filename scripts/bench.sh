#!/usr/bin/env bash
# Run every benchmark in bench/; each writes bench/results/NAME.json (from code only: command, commit, load
# average, versions, the baseline it measured in the same run). Then regenerate the README/docs figures from them.
#   bash scripts/bench.sh                 # all (about 10 minutes on 2 quiet cores, ep_layer and plan_compare most)
#   bash scripts/bench.sh simulate        # only the benchmarks whose name contains "simulate"
# Commit bench/results/ with the figures: tests/test_readme_figures.py checks they agree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { bash scripts/setup.sh; PY=.venv/bin/python; }
only=${1:-}
run() {
  local name=$1; shift
  if [ -n "$only" ] && [[ "$name" != *"$only"* ]]; then return 0; fi
  echo "== bench: $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$PY" "bench/$name.py" "$@"
}
run simulate_speed
run analyse_speed
run eplb_speed
run eplb_next_window
run joint_speed
run capture_overhead
run kernel_validation
run plan_time
run operate_policies
run operate_overhead
if [ -d ../shared/data/gpt-oss-20b ]; then
  run plan_compare
else
  echo "== bench: plan_compare skipped (../shared/data/gpt-oss-20b absent)"
fi
run ep_layer
if [ -d src/moeplace/data/reference-foe.trace ] && [ -d src/moeplace/data/reference-foe-h4.trace ]; then
  run foe_ep
else
  echo "== bench: foe_ep on synthetic FoE traces (src/moeplace/data/reference-foe*.trace absent)"
  run foe_ep --synthetic
fi
run foe_quality
"$PY" scripts/readme_figures.py
echo "results in bench/results/; figures in README.md and docs/ regenerated"
