"""An elastic job on MPI: `tandem run --backend mpi -np N --min-np A`, whose world shrinks.

    tandem run --backend mpi -np 3 --min-np 2 train.py     # Open MPI 5 with ULFM

The ranks start as for any MPI job (`mpiexec.MPIExecRanks`, one supervisor per rank), with
Open MPI's fault tolerance on (`mpiexec --with-ft ulfm`) over its TCP transport (`--mca btl
self,tcp`: over shared memory alone a lost rank is seen only by ULFM's heartbeat detector,
which on busy cores hung survivors at exit and reported healthy ranks dead; see
`fault_tolerance`), and `TANDEM_MPI_ON_FAILURE=shrink`. When a rank fails, the survivors'
next collective fails with MPI_ERR_PROC_FAILED; `td.elastic.run` then shrinks the world to
the ranks alive (`runtime.shrink`: ULFM's revoke and shrink), restores the last
`td.elastic.State.commit()` and goes on. Each rank keeps its first rank as its worker id
(`TANDEM_ELASTIC_WORKER`), whatever its rank after a shrink.

The job runs under the one agent (`agents.coordinator.Coordinator`) with `ShrinkingRanks`,
and the one watch (`supervisor.Supervisor`, given `low`, the --min-np) drops a rank that
fails while at least --min-np ranks are running or finished: one line names it, and the job
goes on. A rank whose watchdog names workers that stopped answering reports them on the
agent's store (`fault_tolerance.silent_key`); the agent passes each report on as a
`SilentRanks` event (`Coordinator.watch_silent`), and the watch kills them. Below --min-np the
job stops with the usual report. When every rank is gone the job exits 0 if --min-np or more
finished, with a summary line naming the ranks lost.
An MPI world cannot grow (no rank can join it), so --max-np above -np is refused before
anything starts (`fault_tolerance.elastic_mpi_problem`), as is an MPI without ULFM (MPICH).
"""

from __future__ import annotations

from tandem.launch.agents.coordinator import Coordinator
from tandem.launch.config import LaunchConfig, LaunchError
from tandem.launch.mpi.fault_tolerance import elastic_mpi_problem, silent_key
from tandem.launch.mpi.mpiexec import MPIExecRanks, find_mpiexec, is_open_mpi

# Open MPI's fault tolerance, on its TCP transport (loopback: the ranks share this machine).
ULFM_FLAGS = ("--with-ft", "ulfm")
ULFM_ENVIRONMENT = {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "lo"}


class ShrinkingRanks(MPIExecRanks):
    """MPI ranks started with ULFM on: a failed rank exits, the others shrink the world. The
    ranks' reports of silent workers (`silent_key`) come back as `SilentRanks` events, in order
    (`Coordinator.watch_silent`)."""

    on_failure = "shrink"
    silent_key = staticmethod(silent_key)

    def fault_tolerance(self) -> tuple[list[str], dict[str, str]]:
        return list(ULFM_FLAGS), dict(ULFM_ENVIRONMENT)


def launch(config: LaunchConfig) -> int:
    """Run the elastic MPI job `config` describes; its exit code (0 when --min-np or more
    ranks finished)."""
    problem = elastic_mpi_problem(config)
    if problem is not None:
        raise LaunchError(problem)
    if not is_open_mpi(find_mpiexec()):  # elastic_mpi_problem found ULFM: Open MPI's
        raise LaunchError("an elastic MPI job needs Open MPI's mpiexec (ULFM)")
    return Coordinator(config, nproc=config.np, ranks=ShrinkingRanks).run()  # the one agent
