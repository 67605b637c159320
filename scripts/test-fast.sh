#!/usr/bin/env bash
# The fast tier: every module exercised (launch, the engines, the checks, every wrapper,
# checkpoints, elastic, the front ends) in a few minutes, for before a commit. It leaves out the
# tests tests/conftest.py lists in SLOW, each with why; scripts/test.sh runs them all (the full
# tier, what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
exec .venv/bin/python -m pytest -m "not slow" "$@"
