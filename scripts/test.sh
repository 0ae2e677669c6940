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
# --no-loadscope-reorder: files go out in collection order, which tests/conftest.py sorts longest first (by
# tests/file_seconds.json), so no long file is left alone at the end. One BLAS thread per worker: 2 workers on
# 2 cores, and OpenBLAS's spinning second thread cost CPU the other worker needs (the reference-ds card check: 54 s
# of CPU with 2 threads, 41 s with 1; numpy only, torch has its own threads)
OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" .venv/bin/python -m pytest -n "${MOEPLACE_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder --durations=15 "$@"
.venv/bin/ruff check src tests bench scripts
