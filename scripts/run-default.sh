#!/usr/bin/env bash
# Install everything and run the embedded default experiment (bundled digits, no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedloom run "$@"
