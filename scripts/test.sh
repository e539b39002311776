#!/usr/bin/env bash
# Install everything and run the test suite: the cheap tests by default (what CI runs; the heavy
# ones are counted in the summary), `--heavy` only the heavy ones, `--all` every test. Other
# arguments go to pytest (tests/conftest.py: the heavy mark and the time budgets). The tests run on
# FEDLOOM_TEST_WORKERS pytest-xdist processes (default 2, one per core of the CI machine; each
# test runs torch on one thread); a worker that dies ends the run naming its test. The tests
# marked `ray` run afterwards in one process, alone: a Ray driver beside a busy worker lost its
# 1-CPU test nodes and exited, taking its xdist worker down with it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FEDLOOM_DATA=${FEDLOOM_DATA:-../shared/data}
export FEDLOOM_OFFLINE=1
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/lint-imports  # the layers and no import cycles (pyproject.toml, [tool.importlinter])
.venv/bin/vulture src/fedloom --min-confidence 80  # no unused code
status=0
.venv/bin/python -m pytest -q --durations=25 -n "${FEDLOOM_TEST_WORKERS:-2}" \
  --max-worker-restart=0 -m "not ray" "$@" || status=$?
ray=0
.venv/bin/python -m pytest -q --durations=10 -p no:xdist -m ray "$@" || ray=$?
[ "$ray" -eq 5 ] && ray=0  # no Ray test among the selected ones
[ "$status" -eq 5 ] && status=0
[ "$status" -ne 0 ] && exit "$status"
exit "$ray"
