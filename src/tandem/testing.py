"""The multi-process test harness: real processes, real engines, reused across tests.

    from tandem.testing import run_distributed

    def check_allreduce():                      # runs on every rank, module top level
        t = td.allreduce(torch.ones(3), op="sum")
        assert t.tolist() == [td.size()] * 3

    def test_allreduce():
        run_distributed(check_allreduce, world_size=3)

Starting a world costs seconds (each rank imports torch), so a world of each size and backend
is started once and reused: the local worker pool of `td.spawn` (`launch.local.pool`), kept
alive, its ranks started as every local rank is, or by mpiexec for the MPI backend.
`run_distributed` ships the function (cloudpickle) to every rank and collects its result or
traceback. A rank that raises fails the test with that rank's traceback; a rank that does not
answer within `timeout` has its Python stacks dumped (faulthandler on SIGABRT) into the error.
A world that saw a failure it might not have recovered from is restarted for the next test.
"""

from __future__ import annotations

import atexit
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

from tandem.launch.local.output import RankOutput
from tandem.launch.local.pool import WorkerFailed, WorkerPool, work_message
from tandem.launch.local.ranks import thread_limits

_START_TIMEOUT_S = 120.0
# A shared world whose ranks hold more threads than this is started afresh before its next
# test. Each Gloo group a test makes and does not destroy keeps two threads per rank (its
# device's loop and its run loop), which wake on their own: in one CI run an idle 4-rank world
# had grown to 1,032 threads per rank and took about a fifth of a core per rank, for the rest
# of the suite, on a 2-core machine. A fresh rank has 5 to 30; the 2-rank world that serves
# most of the suite ends it with about 200, and is left alone.
MOST_THREADS = 300
_AFTER_ERROR_GRACE_S = 5.0
_TAIL_LINES = 200  # of each rank's output, for the error: a rank's stacks fit


class DistributedTestError(AssertionError):
    """A rank failed, or did not answer in time; the message holds its traceback or stacks."""


def mpiexec_command(size: int) -> list[str]:
    """`mpiexec -n size`, with the flags tandem's launcher gives the MPI it finds (Open MPI's:
    more ranks than cores, root; see `launch.mpi.mpiexec.start_flags`)."""
    from tandem.launch.mpi.mpiexec import find_mpiexec, start_flags

    mpiexec = find_mpiexec()
    return [mpiexec, *start_flags(mpiexec), "-n", str(size)]


class LocalWorld(WorkerPool):
    """`size` worker processes on this machine that have called `td.init()` and wait for work:
    the local worker pool, kept alive across tests; `processes` are its ranks, or mpiexec for
    the MPI backend."""

    def __init__(self, size: int, backend: str = "gloo", env: dict[str, str] | None = None):
        from tandem import runtime

        self.backend = backend
        self.broken = False
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
        base["TANDEM_TIMEOUT"] = "60"
        # The thread rule of every rank tandem starts, at one thread each: the worlds of a
        # test run share the machine's cores with each other.
        base.update(thread_limits(base, size, per_rank=1))
        base.update(env or {})
        try:
            super().__init__(size, runtime.init, runtime.shutdown, env=base, backend=backend,
                             launcher=mpiexec_command(size) if backend == "mpi" else (),
                             output=RankOutput(echo=False, tail_lines=_TAIL_LINES),
                             start_timeout=_START_TIMEOUT_S)
        except WorkerFailed as failed:
            raise DistributedTestError(f"a {backend} world of {size} ranks: {failed}") from None

    def crowded(self) -> bool:
        """Whether a rank holds more than `MOST_THREADS` threads (Linux; elsewhere never)."""
        return any(threads(pid) > MOST_THREADS for pid in self.pids.values())

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), timeout: float = 120.0):
        """Run `fn(*args)` on every rank; return the results in rank order."""
        reports = self.collect(work_message(fn, tuple(args), "run_distributed"), timeout,
                               _AFTER_ERROR_GRACE_S)
        self.broken = bool(reports.pending or reports.died)
        stuck, stacks = reports.pending, self.dump_stacks(reports.pending) if reports.pending else ""
        if reports.errors:
            first = reports.cause(min)
            others = f" (ranks {sorted(reports.errors)} all raised)" if len(reports.errors) > 1 else ""
            still = f"\n(ranks {stuck} were still waiting; their stacks:)\n{stacks}" if stuck else ""
            raise DistributedTestError(f"rank {first} raised{others}:\n{reports.errors[first]}{still}")
        if stuck:
            raise DistributedTestError(f"ranks {stuck} did not finish {getattr(fn, '__name__', fn)} "
                                       f"within {timeout:.0f} s; their stacks:\n{stacks}")
        return [reports.results[rank] for rank in range(self.size)]


def threads(pid: int) -> int:
    """How many threads process `pid` has (0 when /proc cannot say: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def still_running(pids: Sequence[int], timeout: float = 10.0) -> list[int]:
    """The pids that have not exited within `timeout` (a zombie counts as exited).

    Waits on pidfds, an event per process, so the check ends as soon as every pid is gone.
    """
    deadline, alive = time.monotonic() + timeout, []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
        if not ready:
            alive.append(pid)
    return alive


_worlds: dict[tuple[int, str, tuple], LocalWorld] = {}


def get_world(world_size: int, backend: str = "gloo", env: dict[str, str] | None = None):
    """The shared world of this size, backend and extra environment, started on first use."""
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    world = _worlds.get(key)
    if world is None or world.broken or world.crowded():
        if world is not None:
            world.close()
        world = _worlds[key] = LocalWorld(world_size, backend, env)
    return world


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on every rank of a (reused) world; return the results in rank order.

    `fn` must be defined at module top level. It fails with the first failing rank's traceback.
    """
    world = get_world(world_size, backend, env)
    try:
        return world.run(fn, args, timeout)
    except DistributedTestError:
        if world.broken:
            world.close()
        raise


def close_worlds() -> None:
    """Stop every shared world (the suite's session fixture calls it; so does atexit). All are
    told first, so that their engines shut down side by side, not one world after another."""
    worlds = list(_worlds.values())
    _worlds.clear()
    for world in worlds:
        world.ask_to_stop()
    for world in worlds:
        world.close()


atexit.register(close_worlds)
