"""One local worker pool: the ranks of one job on this machine, each running the work it is sent.

`td.spawn` (`tandem.spawning`) uses one once; `tandem.testing`'s shared worlds keep one alive.

- Start: the parent hosts the job's store and a socket the workers connect back to, and starts
  `size` ranks (`start_ranks`, the one rank-environment builder `local_rank_environment`), or
  one `launcher` (`mpiexec -n N`) that starts them. Each worker proves it holds the pool's key,
  is made like the parent (its `sys.path` and directory; with `like_parent`, its main module:
  multiprocessing's spawn preparation), runs the `setup` it is sent (`td.init`: this module stays
  below the runtime) and answers `("ready", rank, pid)` or `("err", rank, traceback)`.
- Work: `collect` sends `work_message(fn, args)` (cloudpickle: a function of a notebook cell
  travels by value) to every rank and collects `("ok" | "err", rank, result | traceback)`,
  watching each rank's process (a pidfd): a rank that dies is named at once, with its exit and
  last output, and is the cause of its peers' errors (`Reports.cause`). After the first failure
  the others get `grace` seconds to answer; `dump_stacks` makes one that does not print its
  Python stacks (faulthandler on SIGABRT).
- Stop: an empty message; each worker runs `teardown` and leaves with `os._exit` (the
  interpreter's teardown of torch takes seconds of CPU per rank); `close` kills what is left.
"""

from __future__ import annotations

import faulthandler
import hmac
import multiprocessing.spawn
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem import rendezvous
from tandem.job.environments import launched
from tandem.launch.local.output import RankOutput
from tandem.launch.local.processes import KILL_WAIT_S, describe, start_ranks, stop_processes, wait_all
from tandem.launch.local.ranks import local_rank_environment, thread_limits

WORKER = "TANDEM_WORKER_POOL"  # the worker's "host:port key" of the parent's socket
DRAIN_S = 5.0  # how long a stopped rank's output may take to reach us
ABORT_WAIT_S = 10.0  # how long a rank told to dump its stacks may take to die
_KEY_WAIT_S = 5.0  # how long a connection may take to prove it is one of ours


class WorkerFailed(RuntimeError):
    """The pool could not start: `rank` (None: the launcher, or no rank in time) failed its
    setup, died, or did not connect; `detail` says how, with its traceback or last output."""

    def __init__(self, rank: int | None, detail: str) -> None:
        super().__init__(f"rank {rank} could not start:\n{detail}" if rank is not None else detail)
        self.rank, self.detail = rank, detail


@dataclass
class Reports:
    """What the ranks answered to one piece of work."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # tracebacks, in the order they came
    died: set[int] = field(default_factory=set)  # ranks whose error is their death
    pending: list[int] = field(default_factory=list)  # no answer by the deadline

    def cause(self, first: Callable[[Iterable[int]], int] = lambda ranks: next(iter(ranks))) -> int:
        """The rank to blame: one that died (its peers' errors follow from it), else `first`
        of those that raised (default: the first to say so)."""
        return first([rank for rank in self.errors if rank in self.died] or self.errors)


def work_message(fn: Callable[..., Any], args: tuple, sender: str) -> bytes:
    """`(fn, args)` for the workers, or a TypeError naming what cannot go (`sender` says who
    sends it, `td.spawn`)."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args))
    except Exception as exc:
        culprit = _unpicklable_part(fn, args, cloudpickle.dumps)
        raise TypeError(
            f"{sender} cannot send {culprit or 'fn and args'} to the child processes: {exc}. "
            f"Create it inside the function instead (each process needs its own), or pass "
            f"something picklable"
        ) from exc


def _unpicklable_part(fn: Callable[..., Any], args: tuple, dumps: Callable[[Any], bytes]) -> str | None:
    """Which closure variable, global, default or argument of the call cannot be pickled."""
    code = getattr(fn, "__code__", None)
    parts: list[tuple[str, Any]] = [(f"args[{i}]", arg) for i, arg in enumerate(args)]
    if code is not None:
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False)
        parts += [(f"the variable {name!r} that fn closes over", cell.cell_contents)
                  for name, cell in cells]
        namespace = getattr(fn, "__globals__", {})
        parts += [(f"the global {name!r} that fn uses", namespace[name])
                  for name in code.co_names if name in namespace]
        parts += [(f"a default argument of fn ({value!r})", value)
                  for value in getattr(fn, "__defaults__", None) or ()]
    for label, value in parts:
        try:
            dumps(value)
        except Exception:
            text = repr(value)
            text = text if len(text) <= 80 else text[:77] + "..."
            return f"{label} ({type(value).__module__}.{type(value).__qualname__} {text})"
    return None


def _preparation(like_parent: bool) -> bytes:
    """What makes a worker like us: multiprocessing's spawn preparation (main module
    included) with `like_parent`, else our `sys.path` and directory only."""
    if not like_parent:
        return pickle.dumps({"sys_path": sys.path, "dir": os.getcwd()})
    data = multiprocessing.spawn.get_preparation_data("tandem-worker")
    data.pop("authkey", None)  # multiprocessing refuses to pickle it; unused here
    return pickle.dumps(data)


class WorkerPool:
    """`size` ranks of one job on this machine that have run `setup` and wait for work."""

    def __init__(
        self,
        size: int,
        setup: Callable[[], Any],
        teardown: Callable[[], Any],
        *,
        env: Mapping[str, str] | None = None,
        backend: str | None = None,
        launcher: Sequence[str] = (),
        like_parent: bool = False,
        output: RankOutput | None = None,
        start_timeout: float | None = None,
    ) -> None:
        """Start the ranks and wait until every one is ready (`start_timeout` seconds at most;
        None: as long as they live). `env` is their base environment (default ours);
        `launcher`, a command that starts all of them (`mpiexec -n size`) instead of us.

        Raises:
            WorkerFailed: a rank failed its setup or died, the launcher exited, or not every
                rank was ready in time; with the traceback or the last output.
        """
        import cloudpickle

        self.size = size
        self.output = output or RankOutput()
        self.connections: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        self.processes: list[subprocess.Popen] = []  # the ranks, or the launcher
        self._exits: dict[int, int] = {}  # rank -> pidfd: readable once the rank has exited
        self._key = secrets.token_bytes(16)
        self._server = socket.create_server(("127.0.0.1", 0))
        self._store: rendezvous.StoreServer | None = None
        self._launcher = list(launcher)
        self._told_to_stop = False
        try:
            self._start(dict(os.environ if env is None else env), backend)
            hello = [_preparation(like_parent), cloudpickle.dumps((setup, teardown))]
            self._gather(hello, start_timeout)
        except BaseException:
            self.close(grace=0)
            raise

    def _start(self, base: dict[str, str], backend: str | None) -> None:
        host, port = self._server.getsockname()[:2]
        base[WORKER] = f"{host}:{port} {self._key.hex()}"
        command = [sys.executable, "-u", "-m", "tandem.launch.local.pool"]
        if self._launcher:
            envs = [{**base, **thread_limits(base, self.size),
                     **({"TANDEM_BACKEND": backend} if backend else {})}]
            command = [*self._launcher, *command]
        else:
            self._store = rendezvous.StoreServer("127.0.0.1", 0)
            envs = [local_rank_environment(
                base, rank=rank, size=self.size, local_rank=rank, local_size=self.size,
                store=("127.0.0.1", self._store.port), store_key=self._store.key, backend=backend,
            ) for rank in range(self.size)]
        self.processes = start_ranks(command, envs)
        for index, process in enumerate(self.processes):
            self.output.attach(index, process.stdout, process.stderr)
            self._exits[index] = os.pidfd_open(process.pid)  # the launcher's, under one

    def _gather(self, hello: list[bytes], timeout: float | None) -> None:
        """Admit the workers that prove the key, send each `hello`, wait for every `ready`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        started = {fd: index for index, fd in self._exits.items()}
        joining: list[Connection] = []
        while len(self.connections) < self.size:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self._server, *joining, *started], timeout=left)
            if not ready:
                raise WorkerFailed(None, f"only {len(self.connections)} of {self.size} ranks "
                                         f"started within {timeout:.0f} s\n"
                                         f"{self.last_outputs(drain=0)}")
            for connection in [c for c in joining if c in ready or c.poll()]:
                joining.remove(connection)  # a report before an exit: an error says why
                self._ready(connection)
            if self._server in ready and (connection := self._admit(hello)) is not None:
                joining.append(connection)
            for fd in [fd for fd in ready if fd in started]:
                index = started[fd]
                who = self._launcher[0] if self._launcher else f"rank {index}"
                how = describe(self.processes[index].wait())
                raise WorkerFailed(None if self._launcher else index,
                                   f"{who} exited while starting ({how}); "
                                   f"{len(self.connections)} of {self.size} ranks were ready\n"
                                   f"{self.last_outputs([index])}")
        if self._launcher:  # the ranks are the launcher's children: watch each one
            self._exits = {rank: os.pidfd_open(pid) for rank, pid in self.pids.items()}
            for fd in started:
                os.close(fd)

    def _admit(self, hello: list[bytes]) -> Connection | None:
        sock, _ = self._server.accept()
        connection = Connection(sock.detach())
        try:
            if connection.poll(_KEY_WAIT_S) and hmac.compare_digest(
                    connection.recv_bytes(64), self._key):
                for message in hello:
                    connection.send_bytes(message)
                return connection
        except (EOFError, OSError):
            pass
        connection.close()  # not one of ours
        return None

    def _ready(self, connection: Connection) -> None:
        try:
            status, rank, payload = connection.recv()
        except (EOFError, OSError):
            connection.close()
            return  # died: its exit says how
        if status != "ready":
            connection.close()
            raise WorkerFailed(rank, payload)
        self.connections[rank], self.pids[rank] = connection, payload

    # -- work -----------------------------------------------------------------------------
    def collect(self, message: bytes, timeout: float | None = None, grace: float = 5.0,
                last: bool = False) -> Reports:
        """Send `message` (`work_message`) to every rank; collect what each answers within
        `timeout` seconds (None: no limit), `grace` seconds at most after the first failure.
        `last`: each rank leaves once it has answered (a rank that raised then releases the
        peers that wait on it, and they say so at once)."""
        for connection in self.connections.values():
            try:
                connection.send_bytes(message)
            except OSError:
                pass  # it died: its exit says how
        if last:
            self.ask_to_stop()
        reports, pending = Reports(), set(self.connections)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watched = {self.connections[rank]: rank for rank in pending}
            watched.update({self._exits[rank]: rank for rank in pending})
            ready = wait(list(watched), timeout=left)
            if not ready:
                break
            for rank in {watched[item] for item in ready}:
                answer = self._answer(rank)
                pending.discard(rank)
                if answer[0] == "ok":
                    reports.results[rank] = answer[2]
                    continue
                if answer[0] == "died":
                    reports.died.add(rank)
                reports.errors[rank] = answer[2]
                end = time.monotonic() + grace
                deadline = end if deadline is None else min(deadline, end)
        reports.pending = sorted(pending)
        return reports

    def _answer(self, rank: int) -> tuple[str, int, Any]:
        """What `rank` said, or ("died", rank, how it died with its last output)."""
        connection = self.connections[rank]
        try:
            if connection.poll():  # its report comes before its exit
                return connection.recv()
        except (EOFError, OSError):
            pass
        process = None if self._launcher else self.processes[rank]
        try:
            how = "exited" if process is None else describe(process.wait(KILL_WAIT_S))
        except subprocess.TimeoutExpired:
            how = "its connection closed"
        last = self.last_outputs([rank], heading=False)
        return "died", rank, f"died before reporting ({how})\nits last output:\n{last}"

    def last_outputs(self, ranks: Iterable[int] | None = None, heading: bool = True,
                     drain: float = DRAIN_S) -> str:
        """The last lines each of `ranks` (default all) printed, once its output is drained
        (`drain` seconds at most: a rank that ended); under a launcher, the launcher's, which
        holds every rank's."""
        sources = sorted({0 if self._launcher else rank
                          for rank in (range(len(self.processes)) if ranks is None else ranks)})
        self.output.join(drain, sources)
        parts = []
        for source in sources:
            who = self._launcher[0] if self._launcher else f"rank {source}"
            tail = "\n".join(self.output.tail(source)) or "(nothing)"
            parts.append(f"{who}'s last output:\n{tail}" if heading else tail)
        return "\n".join(parts)

    def dump_stacks(self, ranks: list[int]) -> str:
        """Have `ranks` print every thread's stack (SIGABRT: faulthandler, then they die)."""
        for rank in ranks:
            _signal(self._exits[rank], signal.SIGABRT)
        return self.last_outputs(ranks, drain=ABORT_WAIT_S)  # drained: they are gone

    # -- stop -----------------------------------------------------------------------------
    def ask_to_stop(self) -> None:
        """Tell the workers to end (they run `teardown`); `close` waits for them."""
        for connection in self.connections.values():
            try:
                connection.send_bytes(b"")
            except OSError:
                pass
        self._told_to_stop = True

    def close(self, grace: float = 10.0) -> None:
        """Stop the workers: asked, `grace` seconds to end, then killed; release the rest."""
        if not self._told_to_stop:
            self.ask_to_stop()
        wait_all(self.processes, grace)
        stop_processes(self.processes, signal.SIGKILL, grace=0)  # and what each rank started
        for fd in self._exits.values():
            _signal(fd, signal.SIGKILL)  # a launcher's ranks are not our children
            os.close(fd)
        for connection in self.connections.values():
            connection.close()
        self._exits.clear()
        self.connections.clear()
        self.processes = []
        self._server.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        self.output.join(DRAIN_S)


def _signal(pidfd: int, signum: int) -> None:
    """`signum` to the process behind `pidfd` (never to a pid reused since); gone is fine."""
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass


def serve() -> None:
    """A worker's main: connect, become like the parent, `setup`, run work until told to stop."""
    faulthandler.enable(all_threads=True)  # SIGABRT (`dump_stacks`) prints every thread's stack
    address, key = os.environ.pop(WORKER).split()
    host, port = address.rsplit(":", 1)
    connection = Connection(socket.create_connection((host, int(port))).detach())
    connection.send_bytes(bytes.fromhex(key))
    job = launched(os.environ)
    rank = job.rank if job is not None else 0
    try:
        multiprocessing.spawn.prepare(pickle.loads(connection.recv_bytes()))
        setup, teardown = pickle.loads(connection.recv_bytes())
        setup()
    except BaseException:
        connection.send(("err", rank, traceback.format_exc()))
        return
    connection.send(("ready", rank, os.getpid()))
    while message := _next(connection):
        try:
            fn, args = pickle.loads(message)
            connection.send(("ok", rank, fn(*args)))
        except BaseException:
            connection.send(("err", rank, traceback.format_exc()))
    try:
        teardown()
    finally:
        _leave_at_once()


def _next(connection: Connection) -> bytes:
    """The next piece of work; empty when told to stop, or when the parent is gone."""
    try:
        return connection.recv_bytes()
    except EOFError:
        return b""


def _leave_at_once() -> None:
    """End a worker without the interpreter's teardown: unloading torch and its modules takes
    seconds of CPU per rank (5-6 s to close a 3-rank world on a loaded machine, 0.2 s without),
    and a test suite closes a dozen worlds at its end. MPI is finalized here, as mpi4py's exit
    handler would, so that mpiexec sees a clean end."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
