#!/usr/bin/env bash
# GPU validation in one command (README, "GPU check"): every CUDA/NCCL test, the GPU
# benchmarks and `tandem scale`, one report (report.md + report.json) in OUT.
#
#   scripts/gpu-check.sh OUT [--quick] [--only STEP,...] [--deadline S]
#   scripts/gpu-check.sh --vendor .gpu-deps    # copy pytest & co. for a machine without them
#
# Installs nothing and asks no package index: tandem is imported from src/ (PYTHONPATH), next
# to whatever torch the machine has; .gpu-deps/ joins the path when present. Python: $PYTHON,
# else .venv/bin/python when it imports torch, else python3. Exit code 1 when a step failed;
# CUDA steps skipped on a machine without a GPU are not failures. The last line is the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    PYTHON=.venv/bin/python
  else
    PYTHON=python3
  fi
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
