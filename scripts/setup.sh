#!/usr/bin/env bash
# Create (or reuse) .venv and install tandem with everything its demo and tests need.
# Needs nothing but python3. torch is pinned: an unpinned torch pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[mpi,test,examples,tensorboard,notebook]"
