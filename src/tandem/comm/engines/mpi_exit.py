"""Leaving an MPI job: a rank that failed must not hang in `MPI_Finalize`.

MPICH's `MPI_Finalize` (which mpi4py calls at exit) waits for every rank. So a rank that dies
of an exception while its peers still compute does not exit: it waits in `MPI_Finalize` for
ever, its launcher never learns that it failed, and the job hangs instead of stopping. This
module gives the MPI backend the behaviour of `python -m mpi4py`, plus a deadline:

- an uncaught exception (seen through `sys.excepthook`) ends the rank at exit without
  finalizing: `MPI_Abort` (mpiexec or srun then stops the whole job), or, under
  `tandem run --backend mpi` (`TANDEM_MPI_ON_FAILURE=exit`), a plain exit with code 1 that
  the agent reports and acts on like any failed rank;
- a normal exit first waits, up to the job's timeout, for every rank to arrive (one
  non-blocking barrier), so `MPI_Finalize` never waits without a deadline. Ranks that do not
  arrive in time are named, and this rank leaves as a failed one.

`sys.exit(n)` with n != 0 (argparse's errors too) is a failure as well: it reaches no
excepthook, so the guard wraps `sys.exit` to see it, and the rank leaves with code n. Only a
bare `raise SystemExit(n)` goes unseen: such a rank waits for the others like one that finished.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem.job import settings

_POLL_S = 1e-3  # how often a rank at exit checks whether the others have arrived
FINALIZE_S = 30.0  # at most, for MPI_Finalize once every rank passed the exit barrier
_guard: _ExitGuard | None = None


def install(MPI: Any, timeout: float) -> None:
    """Guard this process's exit (once; a later init only updates the deadline).

    Collective over `MPI_COMM_WORLD` the first time: every rank calls it from `td.init`.
    """
    global _guard
    policy = settings.current().mpi_on_failure  # abort | exit, checked there
    if _guard is None:
        _guard = _ExitGuard(MPI, timeout, policy)
    else:
        _guard.timeout, _guard.policy = timeout, policy


def adopt(comm: Any) -> None:
    """The exit barrier meets the ranks of `comm` from now on (a world shrunk after a rank
    failed, `MPIBackend.shrink`): the lost rank would never arrive. Collective over `comm`."""
    if _guard is not None:
        _guard.comm = comm.Dup()
        _guard.shrunk = True


@contextmanager
def deadline(seconds: float, message: str, code: int = 1) -> Iterator[None]:
    """End this process (exit `code`, `message` on stderr) if the block has not finished
    within `seconds`: the deadline of a blocking MPI call that has none of its own (ULFM's
    shrink waits for every rank that has not failed). The call must let go of the GIL
    (mpi4py's communicator calls do), or the timer's thread cannot run."""
    timer = threading.Timer(seconds, _overdue, (message, code))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _overdue(message: str, code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.write(2, f"tandem: {message}\n".encode(errors="replace"))
    os._exit(code)


class _ExitGuard:
    def __init__(self, MPI: Any, timeout: float, policy: str) -> None:
        self.MPI = MPI
        self.timeout = timeout
        self.policy = policy
        self.failure: str | None = None
        self.exit_code = 1
        self.shrunk = False  # the world lost a rank and shrank (`adopt`)
        self.comm = MPI.COMM_WORLD.Dup()  # the exit barrier never meets anyone else's message
        previous = sys.excepthook

        def excepthook(kind, value, traceback) -> None:
            self.failure = kind.__name__
            previous(kind, value, traceback)

        sys.excepthook = excepthook
        real_exit = sys.exit

        def exit(status: object = None) -> None:
            if status is not None and status != 0:
                self.failure = f"sys.exit({status!r})"
                # What Python itself would exit with: the number, or 1 for a message.
                self.exit_code = status if isinstance(status, int) else 1
            real_exit(status)

        sys.exit = exit
        # Registered after mpi4py's own exit handler, so it runs before MPI_Finalize.
        atexit.register(self.leave)

    def leave(self) -> None:
        if self.MPI.Is_finalized():
            return  # the script finalized MPI itself: nothing is left to guard
        rank = self.comm.Get_rank()
        if self.failure is not None:
            self._abandon(f"rank {rank} failed ({self.failure}); leaving the MPI job "
                          "without MPI_Finalize so that the others are stopped")
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        pause = threading.Event()  # never set: a bounded poll period, not a wait for a peer
        while not self._arrived(request, rank):
            if time.monotonic() > deadline:
                self._abandon(
                    f"rank {rank} finished, but not every rank of {self.comm.Get_size()} "
                    f"finished within {self.timeout:g} s after it; leaving without MPI_Finalize"
                )
            pause.wait(_POLL_S)
        self.comm.Free()
        if self.policy == "shrink" or self.shrunk:
            self._finalize(rank)

    def _finalize(self, rank: int) -> None:
        """`MPI_Finalize` under a deadline, in a world that shrinks: Open MPI 5's waits in a
        process-manager fence over every process of the job, the lost one too, and on a busy
        machine that fence sometimes never completed (a survivor of scripts/ulfm-shrink.py sat
        in ompi_mpi_finalize's usleep loop for minutes after the others had left). Every
        survivor has passed the exit barrier by now, so nothing is lost by leaving. Called
        through ctypes, which lets go of the GIL (mpi4py's `MPI.Finalize` keeps it, and the
        deadline's thread could not run); mpi4py's own exit handler then finds MPI
        finalized."""
        try:  # through mpi4py's own module: it loaded libmpi without exporting it
            finalize = ctypes.CDLL(self.MPI.__file__).MPI_Finalize
        except (OSError, AttributeError):
            return  # not found: mpi4py's exit handler finalizes, as in any job
        seconds = min(self.timeout, FINALIZE_S)
        with deadline(seconds, f"rank {rank} finished, but MPI_Finalize did not return within "
                      f"{seconds:g} s (Open MPI's fence with the lost rank); leaving without it",
                      code=0):
            finalize()

    def _arrived(self, request: Any, rank: int) -> bool:
        """Whether every rank reached the exit barrier. In a world that shrinks
        (TANDEM_MPI_ON_FAILURE=shrink) a rank that fails there is lost like any other: this
        one finished, and leaves without MPI_Finalize (which would wait for the lost rank)."""
        try:
            return request.Test()
        except self.MPI.Exception as error:
            if self.policy != "shrink":
                raise
            self.exit_code = 0
            self._abandon(f"rank {rank} finished, but a rank of its world failed at exit "
                          f"({error.Get_error_string()}); leaving without MPI_Finalize")
            raise  # not reached: _abandon exits

    def _abandon(self, message: str) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stderr.write(f"tandem: {message}\n")
        sys.stderr.flush()
        if self.policy != "abort":  # exit, or shrink: the agent stops or goes on without it
            os._exit(self.exit_code)
        self.MPI.COMM_WORLD.Abort(self.exit_code)
