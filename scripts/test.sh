#!/usr/bin/env bash
# Set up (with test tools) and run the whole test suite, then the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m pytest --durations=15 "$@"
.venv/bin/ruff check src tests bench scripts
