#!/usr/bin/env bash
# The engine check (opt-in; never part of the normal suite): moeplace's files checked with the engines' own code.
#   1. makes or reuses the engine venvs (scripts/interop_venvs.sh; outside .venv, pinned versions)
#   2. runs every check in tests/test_interop_engines.py with those venvs
#   3. writes docs/engine-check-report.md and bench/results/engine_check.json (versions, each check's status and
#      what it compared)
# Usage: bash scripts/engine-check.sh [venv-dir]
#   venv-dir: where .venv-vllm / .venv-sglang live (default: the main checkout, which git worktrees share)
# Needs: the project's venv (.venv of this checkout or of the main checkout, or $PYTHON), network for the first
# run only (about 13 GB, 10-20 minutes), then a few minutes on 2 CPU cores. Exit status 1 if a check did not pass.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
main_root=$(cd "$(git -C "$root" rev-parse --path-format=absolute --git-common-dir)/.." && pwd)
venvs=${1:-$main_root}

py=${PYTHON:-}
if [[ -z $py ]]; then
  for cand in "$root/.venv/bin/python" "$main_root/.venv/bin/python"; do
    [[ -x $cand ]] && { py=$cand; break; }
  done
fi
[[ -n $py ]] || { echo "engine-check: no project venv (.venv); run scripts/setup.sh or set PYTHON" >&2; exit 2; }

bash "$root/scripts/interop_venvs.sh" "$venvs" all

export MOEPLACE_VLLM_PYTHON="$venvs/.venv-vllm/bin/python"
export MOEPLACE_SGLANG_PYTHON="$venvs/.venv-sglang/bin/python"
junit=$(mktemp -t engine-check.XXXXXX.xml)
trap 'rm -f "$junit"' EXIT
cd "$root"
set +e
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest tests/test_interop_engines.py -q -rs \
  -p no:cacheprovider --junitxml="$junit"
set -e
PYTHONPATH="$root/src" "$py" scripts/engine_check_report.py "$junit" bench/results/engine_check.json \
  docs/engine-check-report.md --vllm "$MOEPLACE_VLLM_PYTHON" --sglang "$MOEPLACE_SGLANG_PYTHON"
