#!/usr/bin/env bash
# Set up moeplace in ./.venv with pinned versions (idempotent).
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --test   # plus test tools, Debian's chromium (HTML report and dashboard tests) and
#                                  # Debian's prometheus (promtool and the server, for the operate alert tests)
#   MOEPLACE_NO_APT=1 bash scripts/setup.sh --test   # the same without apt-get (those tests are skipped)
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
# System packages for the tests (Debian's apt), said before anything is installed: MOEPLACE_NO_APT=1 skips them
# (the tests that need them are then skipped, each with its reason).
if [ "${1:-}" = "--test" ]; then
  missing=() why=()
  command -v chromium >/dev/null || { missing+=(chromium); why+=("chromium: headless browser that renders the HTML report, compare page and dashboard in their tests"); }
  command -v prometheus >/dev/null || { missing+=(prometheus); why+=("prometheus: promtool and the server, for the operate alert-rule tests"); }
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== system packages the tests use, not installed here:"
    printf '     %s\n' "${why[@]}"
    if [ -n "${MOEPLACE_NO_APT:-}" ]; then
      echo "   MOEPLACE_NO_APT is set: not installing them; their tests will be skipped"
    elif [ "$(id -u)" != 0 ]; then
      echo "warning: not root, cannot apt-get install ${missing[*]}; their tests will be skipped" >&2
    else
      echo "== apt-get install ${missing[*]} (set MOEPLACE_NO_APT=1 to skip)"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
        || echo "warning: could not install ${missing[*]}; their tests will be skipped" >&2
    fi
  fi
fi
