#!/usr/bin/env bash
# Record an FoE model's routing on its held-out prompts: prefill + 32 decode tokens per prompt, greedy.
#   bash scripts/make_foe_trace.sh MODEL_DIR OUT.trace [extra trace-record options, e.g. --overwrite]
# MODEL_DIR: a folder written by `moeplace train-reference --foe-groups H ...` (it holds heldout_prompts.jsonl).
# The trace's meta.json says foe_groups = H; each layer's K ids are ordered group by group (docs/TRACE_FORMAT.md).
# The shipped reference-foe.trace is made this way from the trained FoE reference model (docs/FOE.md, "Traces").
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL_DIR OUT.trace [trace-record options]" >&2
  exit 2
fi
model=$1; out=$2; shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$root/.venv/bin/python}
[ -x "$PY" ] || PY=python
prompts=$model/heldout_prompts.jsonl
[ -f "$prompts" ] || { echo "$0: $prompts: no such file (expected a train-reference model folder)" >&2; exit 2; }
grep -q '"foe_groups"' "$model/config.json" || echo "$0: note: $model/config.json has no foe_groups (a plain MoE)" >&2
exec "$PY" -m moeplace trace record --model "$model" --prompts "$prompts" --max-new-tokens 32 "$out" "$@"
