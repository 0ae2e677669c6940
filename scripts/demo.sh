#!/usr/bin/env bash
# Set up and run the main job on the bundled default trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moeplace demo "$@"
