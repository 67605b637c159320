#!/usr/bin/env bash
# The test suite: real processes over real Gloo and MPI, every test under a timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
exec .venv/bin/python -m pytest "$@"
