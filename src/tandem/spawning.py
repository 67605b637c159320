"""`td.spawn`: run a function on N local processes that have joined one job.

The notebook and test pattern. The parent hosts the rendezvous store (so the port is free and
stays free) and starts the children the way `tandem run` starts its ranks
(`launch.local.processes.start_ranks`: each in a session of its own, with the same `TANDEM_*`
variables), running `python -m tandem.spawning`. Each child reads, from a pipe of its own, what
`multiprocessing`'s spawn start method would give it (the parent's `sys.path`, working
directory and main module, so that `fn` may live in the script that calls `spawn`), then `fn`
and `args`, and reports on a second pipe. The first child that raises or dies stops the
others, and its rank and traceback are re-raised in the parent as `SpawnError`; a child that
died before reporting (a crash, an import error) brings its last lines of output instead.

`fn` and `args` travel with cloudpickle: a function defined in a notebook cell or in
`python -c` lives in a `__main__` that has no file, so the child cannot import it by name
(plain pickle's `Can't get attribute 'run' on <module '__main__'>`); cloudpickle sends such a
function by value and importable ones by name, as pickle does. Forking instead would copy a
parent that runs threads (a Jupyter kernel's, torch's thread pools) with their locks in
whatever state they were, a known source of hangs in the child; fresh processes started
from the same interpreter have none of that.

The children's output goes through pipes into ours, `[rank] `-prefixed as under `tandem run`:
in a notebook their prints appear in the cell that called `spawn`.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem import rendezvous
from tandem.launch.local.output import RankOutput
from tandem.launch.local.processes import describe, start_ranks, stop_processes
from tandem.launch.local.ranks import local_rank_environment

# How long a reported error waits for a peer death that would explain it.
_CAUSE_GRACE_S = 3.0
_FDS = "TANDEM_SPAWN_FDS"  # the child's two pipes: work to read, report to write
_DRAIN_S = 5.0  # how long the stopped children's output may take to reach us


class SpawnError(RuntimeError):
    """A child process raised or died; `rank` says which, the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


class _Died(SpawnError):
    """A child exited without reporting: its last output is added once it has been drained."""


class _Child:
    """The parent's view of one child: its process, its report pipe, its exit as a waitable."""

    def __init__(self, process, reader: Connection) -> None:
        self.process, self.reader = process, reader
        self.exited = os.pidfd_open(process.pid)  # readable once the process has exited

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def close(self) -> None:
        self.reader.close()
        os.close(self.exited)


def _root_cause(children: list[_Child], results: dict, error: SpawnError) -> SpawnError:
    """A rank that died is the cause of its peers' errors ("connection reset"): prefer it.

    The peers notice a death before the parent does, so give the deaths a short deadline to
    show up before blaming the rank that merely reported first.
    """
    others = [c for r, c in enumerate(children) if r != error.rank and r not in results]
    wait([c.exited for c in others], timeout=_CAUSE_GRACE_S)
    for rank, child in enumerate(children):
        if child.exitcode not in (None, 0):
            return _Died(rank, f"{describe(child.exitcode)}; rank {error.rank} "
                               f"then failed with:\n{error}")
    return error


def _pickled(fn: Callable[..., Any], args: tuple, backend: str | None) -> bytes:
    """`fn`, `args` and `backend` for the children, or a TypeError naming what cannot go."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, backend))
    except Exception as exc:
        culprit = _unpicklable_part(fn, args, cloudpickle.dumps)
        raise TypeError(
            f"td.spawn cannot send {culprit or 'fn and args'} to the child processes: {exc}. "
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
            return f"{label} ({type(value).__module__}.{type(value).__qualname__} {_short(value)})"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _start(nprocs: int, store: rendezvous.StoreServer, backend: str | None,
           output: RankOutput) -> tuple[list[_Child], list[Connection]]:
    """Start the children, their output copied by `output`; return them and the pipes to
    send each its work."""
    pipes = [(os.pipe(), os.pipe()) for _ in range(nprocs)]  # (work r/w, report r/w)
    # The environment and thread rule of `tandem run`'s ranks (`local_rank_environment`).
    envs = [{**local_rank_environment(os.environ, rank=rank, size=nprocs, local_rank=rank,
                                      local_size=nprocs, store=("127.0.0.1", store.port),
                                      store_key=store.key, backend=backend),
             _FDS: f"{work_r} {report_w}"}
            for rank, ((work_r, _), (_, report_w)) in enumerate(pipes)]
    try:
        processes = start_ranks(
            [sys.executable, "-u", "-m", "tandem.spawning"], envs,
            pass_fds=lambda rank: (pipes[rank][0][0], pipes[rank][1][1]),
        )
    finally:
        for (work_r, _), (_, report_w) in pipes:
            os.close(work_r)  # the children's ends
            os.close(report_w)
    for rank, process in enumerate(processes):
        output.attach(rank, process.stdout, process.stderr)
    children = [_Child(p, Connection(report_r, writable=False))
                for p, (_, (report_r, _)) in zip(processes, pipes, strict=True)]
    return children, [Connection(work_w, readable=False) for (_, work_w), _ in pipes]


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` processes of one job; return the results in rank order.

    `fn` may be defined anywhere, a notebook cell or `python -c` included (it is sent with
    cloudpickle); what it closes over and `args` must be picklable.

    Args:
        fn: the function each process runs after `td.init()`; its result must be picklable.
        nprocs: the number of processes (ranks), on this machine.
        args: the positional arguments of `fn`, the same for every rank.
        backend: the backend each process's `td.init` uses (None: its default choice).

    Returns:
        `fn`'s results, a list in rank order.

    Raises:
        SpawnError: a rank raised or died; names the rank, with its traceback (the first
            failure's) or its exit and its last output.
        TypeError: `fn` or `args` cannot be pickled (the unpicklable part named).
        ValueError: `nprocs` is below 1.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    work = _pickled(fn, tuple(args), backend)
    store = rendezvous.StoreServer("127.0.0.1", 0)
    preparation = multiprocessing.spawn.get_preparation_data("tandem-spawn")
    preparation.pop("authkey", None)  # multiprocessing refuses to pickle it; unused here
    preparation = pickle.dumps(preparation)
    output = RankOutput()
    children, senders = _start(nprocs, store, backend, output)
    death: _Died | None = None
    try:
        results = _collect(children, senders, (preparation, work))
    except _Died as error:
        death = error
    finally:
        stop_processes([child.process for child in children])
        output.join(_DRAIN_S)
        for child in children:
            child.close()
        store.close()
    if death is not None:
        last = "\n".join(output.tail(death.rank)) or "(nothing)"
        raise SpawnError(death.rank, f"{death.detail}\nits last output:\n{last}") from None
    return [results[rank] for rank in range(nprocs)]


def _collect(children: list[_Child], senders: list[Connection], messages: tuple[bytes, ...]) -> dict:
    """Send every child its work; wait for every report, or raise at the first failure."""
    results: dict[int, Any] = {}
    for sender in senders:
        try:
            for message in messages:
                sender.send_bytes(message)
        except OSError:
            pass  # it died at once; its exit says how
        sender.close()
    readers = {child.reader: rank for rank, child in enumerate(children)}
    while len(results) < len(children):
        ready = wait(list(readers) + [c.exited for c in children if c.exitcode is None])
        for connection in [c for c in ready if c in readers]:
            rank = readers.pop(connection)
            try:
                status, _, payload = connection.recv()
            except EOFError:
                continue  # died before reporting: its exit code tells how
            if status == "err":
                raise _root_cause(children, results, SpawnError(rank, payload))
            results[rank] = payload
        for rank, child in enumerate(children):
            reader = child.reader
            if rank not in results and child.exitcode is not None and not (
                reader in readers and reader.poll()
            ):
                raise _Died(rank, f"died before reporting ({describe(child.exitcode)})")
    return results


def _child() -> None:
    """A child of `spawn`: become like the parent (multiprocessing's preparation), then run."""
    work_fd, report_fd = map(int, os.environ.pop(_FDS).split())
    work, report = Connection(work_fd, writable=False), Connection(report_fd, readable=False)
    rank = int(os.environ["TANDEM_RANK"])
    import tandem as td

    try:
        multiprocessing.spawn.prepare(pickle.loads(work.recv_bytes()))
        fn, args, backend = pickle.loads(work.recv_bytes())
        td.init(backend=backend)
        report.send(("ok", rank, fn(*args)))
    except BaseException:
        report.send(("err", rank, traceback.format_exc()))
    finally:
        td.shutdown()
        report.close()


if __name__ == "__main__":
    _child()
