#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install fedloom (with its test and ray extras) with torch pinned to the 2.13.0 CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test,ray]"
