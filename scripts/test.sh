#!/usr/bin/env bash
# Install everything and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FEDLOOM_DATA=${FEDLOOM_DATA:-../shared/data}
export FEDLOOM_OFFLINE=1
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/lint-imports  # the layers and no import cycles (pyproject.toml, [tool.importlinter])
.venv/bin/python -m pytest -q --durations=25 "$@"
