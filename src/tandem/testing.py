"""The multi-process test harness: real processes, real engines, reused across tests.

    from tandem.testing import run_distributed

    def check_allreduce():                      # runs on every rank, module top level
        t = td.allreduce(torch.ones(3), op="sum")
        assert t.tolist() == [td.size()] * 3

    def test_allreduce():
        run_distributed(check_allreduce, world_size=3)

Starting a world costs seconds (each rank imports torch), so a world of each size and backend
is started once and reused: `run_distributed` ships the function (pickled by reference) to its
ranks and collects `("ok" | "err", rank, result | traceback)` from each. The ranks are started
as every local rank is (`launch.local.processes.start_ranks`), by mpiexec for the MPI backend. A rank
that raises fails the test with that rank's traceback; a rank that does not answer within
`timeout` has its Python stacks dumped (faulthandler on SIGABRT) into the error, and the world
is discarded. Any world that saw a failure it might not have recovered from is restarted for the next test.
"""

from __future__ import annotations

import atexit
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

from tandem.launch.local.processes import start_ranks, stop_processes, wait_all
from tandem.launch.local.ranks import local_rank_environment, thread_limits

_START_TIMEOUT_S = 120.0
_AFTER_ERROR_GRACE_S = 5.0
_LOG_TAIL_CHARS = 4000


class DistributedTestError(AssertionError):
    """A rank failed, or did not answer in time; the message holds its traceback or stacks."""


def mpiexec_command(size: int) -> list[str]:
    """`mpiexec -n size`, with the flags tandem's launcher gives the MPI it finds (Open MPI's:
    more ranks than cores, root; see `launch.mpi.mpiexec.start_flags`)."""
    from tandem.launch.mpi.mpiexec import find_mpiexec, start_flags

    mpiexec = find_mpiexec()
    return [mpiexec, *start_flags(mpiexec), "-n", str(size)]


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL_CHARS:]


class LocalWorld:
    """`size` worker processes on this machine that have called `td.init()` and wait for work."""

    def __init__(self, size: int, backend: str = "gloo", env: dict[str, str] | None = None):
        self.size = size
        self.backend = backend
        self._env = dict(env or {})
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"tandem-test-{backend}{size}-"))
        self._processes: list[subprocess.Popen] = []
        self._connections: dict[int, Connection] = {}
        self._pids: dict[int, int] = {}
        self._store = None
        self._told_to_stop = False
        self.broken = False
        self._start()

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The processes this world started: its ranks, or mpiexec for the MPI backend."""
        return list(self._processes)

    # -- start and stop -------------------------------------------------------------------
    def _base_env(self, address, authkey: bytes) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONUNBUFFERED="1",
            TANDEM_TEST_ADDRESS=f"{address[0]}:{address[1]}",
            TANDEM_TEST_AUTHKEY=authkey.hex(),
            TANDEM_TIMEOUT=self._env.get("TANDEM_TIMEOUT", "60"),
        )
        # The thread rule of every rank tandem starts, at one thread each: the worlds of a
        # test run share the machine's cores with each other.
        env.update(thread_limits(env, self.size, per_rank=1))
        env.update(self._env)
        return env

    def _start(self) -> None:
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = self._base_env(listener.address, authkey)
        command = [sys.executable, "-m", "tandem.testing"]
        if self.backend == "mpi":
            env["TANDEM_BACKEND"] = "mpi"
            command, envs, names = [*mpiexec_command(self.size), *command], [env], ["all"]
        else:
            from tandem import rendezvous

            self._store = rendezvous.StoreServer("127.0.0.1", 0)
            envs = [local_rank_environment(
                env, rank=rank, size=self.size, local_rank=rank, local_size=self.size,
                store=("127.0.0.1", self._store.port), store_key=self._store.key,
                backend=self.backend,
            ) for rank in range(self.size)]
            names = [f"rank{rank}" for rank in range(self.size)]
        logs = [open(self._log_dir / f"{name}.log", "wb") for name in names]  # noqa: SIM115
        try:  # the ranks write their logs; we read them back by name
            self._processes = start_ranks(command, envs, stdout=lambda rank: logs[rank],
                                          stderr=subprocess.STDOUT)
        finally:
            for log in logs:
                log.close()
        try:
            self._accept(listener)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener) -> None:
        accepted: list[Connection] = []

        def accept_all():
            try:
                for _ in range(self.size):
                    accepted.append(listener.accept())
            except OSError:
                pass  # the listener was closed because the start timed out

        thread = threading.Thread(target=accept_all, daemon=True)
        thread.start()
        deadline, exited = time.monotonic() + _START_TIMEOUT_S, None
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.2)
            # A process that is gone before every rank connected (an mpiexec that refused to
            # start the job, a rank that failed its init) will not connect: no need to wait.
            exited = next((p for p in self._processes if p.poll() is not None), None)
            if exited is not None:
                thread.join(1.0)  # connections already made (one saying why it failed)
                break
        if len(accepted) < self.size:
            listener.close()
            for connection in accepted:  # a rank that failed its init says why
                if connection.poll(1):
                    status, rank, payload = connection.recv()
                    if status != "ready":
                        raise DistributedTestError(f"rank {rank} could not init:\n{payload}")
            why = (f"{exited.args[0]} exited with code {exited.returncode}" if exited else
                   f"not within {_START_TIMEOUT_S:.0f} s")
            raise DistributedTestError(
                f"only {len(accepted)} of {self.size} {self.backend} ranks started ({why})"
                f"\n{self._logs()}"
            )
        for connection in accepted:
            status, rank, payload = connection.recv()
            if status != "ready":
                raise DistributedTestError(f"rank {rank} could not init:\n{payload}")
            self._connections[rank] = connection
            self._pids[rank] = payload

    def ask_to_stop(self) -> None:
        """Tell the workers to end (they shut their engine down); `close` waits for them."""
        for connection in self._connections.values():
            try:
                connection.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        self._told_to_stop = True

    def close(self) -> None:
        """Stop the workers (politely, then by force) and forget them."""
        if not self._told_to_stop:
            self.ask_to_stop()
        stop_processes(wait_all(self._processes, 10.0), signal.SIGKILL, grace=0)
        for pid in self._pids.values():
            try:
                os.kill(pid, signal.SIGKILL)  # MPI ranks are not our children
            except ProcessLookupError:
                pass
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
        self._processes.clear()
        if self._store is not None:
            self._store.close()
            self._store = None
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def _logs(self) -> str:
        parts = []
        for path in sorted(self._log_dir.glob("*.log")):
            text = _tail(path).strip()
            if text:
                parts.append(f"--- {path.stem} output ---\n{text}")
        return "\n".join(parts)

    # -- running work ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), timeout: float = 120.0):
        """Run `fn(*args)` on every rank; return the results in rank order."""
        message = pickle.dumps((fn, tuple(args)))
        for connection in self._connections.values():
            connection.send_bytes(message)
        pending = {connection: rank for rank, connection in self._connections.items()}
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, _AFTER_ERROR_GRACE_S)
            ready = wait(list(pending), timeout=max(remaining, 0))
            if not ready:
                break
            for connection in ready:
                rank = pending.pop(connection)
                try:
                    status, _, payload = connection.recv()
                except (EOFError, OSError):
                    status, payload = "err", f"rank {rank} died\n{self._logs()}"
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
        if pending:
            self.broken = True
            stuck = sorted(pending.values())
            stacks = self._dump_stacks(stuck)
            if errors:
                first = min(errors)
                raise DistributedTestError(
                    f"rank {first} raised:\n{errors[first]}\n(ranks {stuck} were still waiting; "
                    f"their stacks:)\n{stacks}"
                )
            raise DistributedTestError(
                f"ranks {stuck} did not finish {getattr(fn, '__name__', fn)} within "
                f"{timeout:.0f} s; their stacks:\n{stacks}"
            )
        if errors:
            first = min(errors)
            others = f" (ranks {sorted(errors)} all raised)" if len(errors) > 1 else ""
            raise DistributedTestError(f"rank {first} raised{others}:\n{errors[first]}")
        return [results[rank] for rank in range(self.size)]

    def _dump_stacks(self, ranks: list[int]) -> str:
        """faulthandler prints every thread's stack on SIGABRT; then the rank dies."""
        for rank in ranks:
            try:
                os.kill(self._pids[rank], signal.SIGABRT)
            except ProcessLookupError:
                pass
        wait_all(self._processes, 10.0)
        return self._logs()


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
    if world is None or world.broken:
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


def _worker() -> None:
    """A rank of a `LocalWorld`: init, then run what the parent sends until told to stop."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    host, port = os.environ["TANDEM_TEST_ADDRESS"].rsplit(":", 1)
    connection = Client((host, int(port)), authkey=bytes.fromhex(os.environ["TANDEM_TEST_AUTHKEY"]))
    import tandem as td

    try:
        world = td.init()
    except BaseException:
        connection.send(("err", os.environ.get("TANDEM_RANK", "?"), traceback.format_exc()))
        return
    connection.send(("ready", world.rank, os.getpid()))
    while True:
        try:
            task = pickle.loads(connection.recv_bytes())
        except EOFError:
            break
        except BaseException:
            connection.send(("err", world.rank, traceback.format_exc()))
            continue
        if task is None:
            break
        fn, args = task
        try:
            connection.send(("ok", td.rank(), fn(*args)))
        except BaseException:
            connection.send(("err", world.rank, traceback.format_exc()))
    td.shutdown()
    _leave_at_once()


def _leave_at_once() -> None:
    """End a worker without the interpreter's teardown: unloading torch and its modules takes
    seconds of CPU per rank (5-6 s to close a 3-rank world on a loaded machine, 0.2 s without),
    and a suite closes a dozen worlds at its end. The engine is already shut down; MPI is
    finalized here, as mpi4py's exit handler would, so that mpiexec sees a clean end."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker()
