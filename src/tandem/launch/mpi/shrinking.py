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

This agent (`ShrinkingJob`) watches the ranks like a fixed job's, except that a rank that
fails is dropped while at least --min-np ranks are running or finished: one line names it,
and the job goes on. Below --min-np the job stops with the usual report. When every rank is
gone the job exits 0 if --min-np or more finished, with a summary line naming the ranks lost.
An MPI world cannot grow (no rank can join it), so --max-np above -np is refused before
anything starts (`fault_tolerance.elastic_mpi_problem`), as is an MPI without ULFM (MPICH).
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import dataclass

from tandem import rendezvous
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.launch.config import LaunchConfig, LaunchError, check_program
from tandem.launch.events import Event
from tandem.launch.local.joined import JoinWatch
from tandem.launch.local.output import signals_blocked
from tandem.launch.local.processes import describe
from tandem.launch.local.ranks import MASTER_ADDR, Placement
from tandem.launch.local.supervisor import (
    DRAIN_S,
    Agent,
    Failure,
    StartInterrupted,
    Supervisor,
    silent_ranks,
    summary,
)
from tandem.launch.mpi.fault_tolerance import elastic_mpi_problem, silent_key
from tandem.launch.mpi.mpiexec import MPIExecRanks, find_mpiexec, is_open_mpi

# Open MPI's fault tolerance, on its TCP transport (loopback: the ranks share this machine).
ULFM_FLAGS = ("--with-ft", "ulfm")
ULFM_ENVIRONMENT = {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "lo"}
SILENT_POLL_S = 1.0  # how long the store's reports of silent ranks are waited for at a time


@dataclass(frozen=True)
class SilentReported(Event):
    """A rank's wait timed out and these workers did not answer its watchdog (stopped, hung):
    the agent kills them, and the others shrink the world without them."""

    workers: tuple[int, ...]
    by: int
    waited: float


class ShrinkingRanks(MPIExecRanks):
    """MPI ranks started with ULFM on: a failed rank exits, the others shrink the world."""

    on_failure = "shrink"

    def fault_tolerance(self) -> tuple[list[str], dict[str, str]]:
        return list(ULFM_FLAGS), dict(ULFM_ENVIRONMENT)


class ShrinkingWatch(Supervisor):
    """The watch of an elastic MPI job: a failed rank is dropped down to `low` ranks."""

    def __init__(self, ranks: ShrinkingRanks, events, output, low: int) -> None:
        super().__init__(ranks, events, output)
        self.low = low
        self.finished: set[int] = set()
        self.dropped: dict[int, int] = {}  # rank (its first rank) -> its exit code
        self.silenced: dict[int, str] = {}  # rank -> why it was killed (it stopped answering)

    def other(self, event: Event) -> None:
        if not isinstance(event, SilentReported) or self.stopping:
            return
        for rank in sorted(set(event.workers) & self.ranks.live - set(self.silenced)):
            self.silenced[rank] = (f"stopped answering (rank {event.by}'s wait for it timed out "
                                   f"after {event.waited:g} s and it did not answer the "
                                   "watchdog: stopped, hung or deadlocked); killed")
            self.output.message(f"tandem run: elastic: rank {rank} (pid {self.ranks.pids[rank]}) "
                                f"did not answer rank {event.by}'s watchdog after a "
                                f"{event.waited:g} s wait: killing it (SIGKILL)")
            self.ranks.signal(signal.SIGKILL, {rank})

    def rank_finished(self, rank: int) -> None:
        self.finished.add(rank)

    def rank_exited(self, rank: int, returncode: int) -> None:
        if returncode == EXIT_PREEMPTED or self.failure is not None or self.stopping:
            super().rank_exited(rank, returncode)
            return
        running = len(self.ranks.live)
        left = running + len(self.finished)
        how = self.silenced.get(rank, describe(returncode))
        if left >= self.low:
            self.dropped[rank] = returncode
            self.output.message(
                f"tandem run: elastic: world {running + 1} -> {running}: rank {rank} (pid "
                f"{self.ranks.pids[rank]}) {how}; the other ranks shrink the MPI world and go "
                f"on (--min-np {self.low})" if running else
                f"tandem run: elastic: rank {rank} (pid {self.ranks.pids[rank]}) {how} after "
                f"the others finished")
            return
        self.output.message(f"tandem run: rank {rank} {how}; {left} rank(s) left, below "
                            f"--min-np {self.low}: stopping the job")
        self.stop(self.rank_failure(rank, returncode))


class ShrinkingJob(Agent):
    """An elastic job of `config.np` MPI ranks on this machine, down to `config.min_np`."""

    def _run(self) -> int:
        with signals_blocked():  # the store's threads leave our signals to this one
            store = rendezvous.StoreServer(MASTER_ADDR, 0)  # lives until the ranks are gone
        placement = Placement.single(self.config.np, store.port, store.key)
        watch = JoinWatch(store)
        supervisor = None
        stop = threading.Event()
        with signals_blocked():
            threading.Thread(target=self._watch_silent, args=(store, stop),
                             name="tandem-mpi-silent", daemon=True).start()
        try:
            try:
                self.ranks.start(placement)
            except StartInterrupted as interrupt:
                failure = Failure(interrupt=interrupt.signum, startup=True)
            else:
                supervisor = ShrinkingWatch(self.ranks, self.events, self.output,
                                            self.config.min_np or 1)
                failure = supervisor.run()
        finally:
            stop.set()
            self.ranks.reap()
            store.close()
        self.output.join(DRAIN_S)
        if supervisor is not None and supervisor.preempted and (
                failure is None or failure.interrupt is not None):
            self.output.message(f"tandem run: preempted: rank(s) {sorted(supervisor.preempted)} "
                                f"saved at the step they agreed on; exit {EXIT_PREEMPTED}")
            return EXIT_PREEMPTED
        if failure is not None:
            if failure.interrupt is not None:
                if failure.startup:
                    self.output.message(f"tandem run: interrupted during start-up "
                                        f"({signal.Signals(failure.interrupt).name}); stopped "
                                        f"{self.config.np} rank(s)")
                return failure.code
            tail = tuple(self.output.tail(failure.rank))
            self.output.message(summary(Failure(
                rank=failure.rank, pid=failure.pid, returncode=failure.returncode, tail=tail,
                silent=silent_ranks(self.output, self.config.np))))
            return failure.code
        if supervisor is not None and supervisor.dropped:
            lost = "; ".join(f"rank {rank} (pid {self.ranks.pids[rank]}) {describe(code)}"
                             for rank, code in sorted(supervisor.dropped.items()))
            self.output.message(
                f"tandem run: elastic: the job ended on {len(supervisor.finished)} of "
                f"{self.config.np} ranks (--min-np {self.config.min_np or 1}), without {lost}")
        return self.independent_copies(watch)


    def _watch_silent(self, store: rendezvous.StoreServer, stop: threading.Event) -> None:
        """The ranks' reports of silent workers (`td.elastic.run`), as events, in order."""
        number = 1
        while not stop.is_set():
            if not store.wait_for([silent_key(number)], SILENT_POLL_S):
                continue  # (the store closes only after `stop` is set)
            report = json.loads(store.get(silent_key(number)))
            self.events.put(SilentReported(tuple(report["workers"]), report["by"],
                                           report["waited"]))
            number += 1


def launch(config: LaunchConfig) -> int:
    """Run the elastic MPI job `config` describes; its exit code (0 when --min-np or more
    ranks finished)."""
    problem = elastic_mpi_problem(config)
    if problem is not None:
        raise LaunchError(problem)
    check_program(config)
    if not is_open_mpi(find_mpiexec()):  # elastic_mpi_problem found ULFM: Open MPI's
        raise LaunchError("an elastic MPI job needs Open MPI's mpiexec (ULFM)")
    return ShrinkingJob(config, ranks=ShrinkingRanks).run()
