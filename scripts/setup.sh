#!/usr/bin/env bash
# Set up moeplace in ./.venv with pinned versions (idempotent).
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --test   # plus test tools, Debian's chromium (HTML report and dashboard tests) and
#                                  # Debian's prometheus (promtool and the server, for the operate alert tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# constraints.txt pins every package, transitive ones included; torch==2.13.0 is the CPU build on this disk.
stamp=".venv/.moeplace-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "== installing moeplace${extras} (pinned by constraints.txt)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".${extras}" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -c "import moeplace, torch, transformers, pyarrow" || { echo "setup failed" >&2; exit 1; }
  touch "$stamp"
fi
if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null; then
  echo "== installing Debian's chromium for the report rendering test"
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the browser test will be skipped" >&2
  else
    echo "warning: not root, cannot apt-get install chromium; the browser test will be skipped" >&2
  fi
fi
if [ "${1:-}" = "--test" ] && ! command -v prometheus >/dev/null; then
  echo "== installing Debian's prometheus (promtool + server) for the operate alert tests"
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo "warning: could not install prometheus; the alert tests will be skipped" >&2
  else
    echo "warning: not root, cannot apt-get install prometheus; the alert tests will be skipped" >&2
  fi
fi
