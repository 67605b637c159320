#!/usr/bin/env bash
# The test suite: real processes over real Gloo and MPI, every test under a timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
# TEST_WORKERS=2 runs the tests on two pytest-xdist workers, a file to a worker (many slow tests
# wait for a watchdog, a signal or a requeue more than they compute); the default, 1, runs them
# in this process, one at a time, as CI does.
workers=${TEST_WORKERS:-1}
if [ "$workers" -gt 1 ]; then
  set -- -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
