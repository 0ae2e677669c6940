#!/usr/bin/env bash
# Set up (with test tools) and run the whole test suite, then the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# numba kernels compiled once into their cache first (skipped when current): otherwise each worker, CLI subprocess
# and Ray worker compiles the same kernels at the same time on a fresh clone
.venv/bin/python scripts/warm_jit.py
# 2 workers (MOEPLACE_TEST_WORKERS), each running whole test files: files that share a fixture or a cluster stay
# together; every test picks its own ports, names and temporary folders
.venv/bin/python -m pytest -n "${MOEPLACE_TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
.venv/bin/ruff check src tests bench scripts
