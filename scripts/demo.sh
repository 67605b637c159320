#!/usr/bin/env bash
# The demo: a 2-rank data-parallel job training a small CNN on scikit-learn's digits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tandem run -np 2 examples/train_digits.py "$@"
