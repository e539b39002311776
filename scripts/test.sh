#!/usr/bin/env bash
# Install everything and run the test suite: the cheap tests by default (what CI runs; the heavy
# ones are counted in the summary), `--heavy` only the heavy ones, `--all` every test. Other
# arguments go to pytest (tests/conftest.py: the heavy mark and the time budgets). The tests run on
# FEDLOOM_TEST_WORKERS pytest-xdist processes (default 2, one per core of the CI machine; each
# test runs torch on one thread), the Ray tests on one of them (their xdist_group). A worker that
# dies ends the run naming its test (--max-worker-restart=0: xdist 3.8's loadgroup hangs on a
# replaced worker, pytest-xdist#1378).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FEDLOOM_DATA=${FEDLOOM_DATA:-../shared/data}
export FEDLOOM_OFFLINE=1
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/lint-imports  # the layers and no import cycles (pyproject.toml, [tool.importlinter])
.venv/bin/vulture src/fedloom --min-confidence 80  # no unused code
.venv/bin/python -m pytest -q --durations=25 -n "${FEDLOOM_TEST_WORKERS:-2}" --dist loadgroup --max-worker-restart=0 "$@"
