"""`td.spawn`: run a function on N local processes that have joined one job.

The notebook and test pattern. The parent hosts the rendezvous store (so the port is free and
stays free) and starts the children the way `tandem run` starts its ranks
(`launch.processes.start_ranks`: each in a session of its own, with the same `TANDEM_*`
variables), running `python -m tandem.spawning`. Each child reads, from a pipe of its own, what
`multiprocessing`'s spawn start method would give it (the parent's `sys.path`, working
directory and main module, so that `fn` may live in the script that calls `spawn`), then the
pickled `fn` and `args`, and reports on a second pipe. The first child that raises or dies
stops the others, and its rank and traceback are re-raised in the parent as `SpawnError`.
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
from tandem.environments import tandem_variables
from tandem.launch.processes import describe, start_ranks, stop_processes

# How long a reported error waits for a peer death that would explain it.
_CAUSE_GRACE_S = 3.0
_FDS = "TANDEM_SPAWN_FDS"  # the child's two pipes: work to read, report to write


class SpawnError(RuntimeError):
    """A child process raised or died; `rank` says which, the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


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
            return SpawnError(rank, f"{describe(child.exitcode)}; rank {error.rank} "
                                    f"then failed with:\n{error}")
    return error


def _start(nprocs: int, port: int, backend: str | None) -> tuple[list[_Child], list[Connection]]:
    """Start the children; return them and the pipes to send each its work."""
    pipes = [(os.pipe(), os.pipe()) for _ in range(nprocs)]  # (work r/w, report r/w)
    envs = [{**os.environ, **tandem_variables(
        rank=rank, size=nprocs, local_rank=rank, local_size=nprocs, master_addr="127.0.0.1",
        master_port=port, backend=backend), _FDS: f"{work_r} {report_w}"}
        for rank, ((work_r, _), (_, report_w)) in enumerate(pipes)]
    try:
        processes = start_ranks(
            [sys.executable, "-m", "tandem.spawning"], envs, stdout=None, stderr=None,
            pass_fds=lambda rank: (pipes[rank][0][0], pipes[rank][1][1]),
        )
    finally:
        for (work_r, _), (_, report_w) in pipes:
            os.close(work_r)  # the children's ends
            os.close(report_w)
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

    `fn` must be importable (defined at module top level), as with `torch.multiprocessing`.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    store = rendezvous.host_store("127.0.0.1", 0)
    preparation = multiprocessing.spawn.get_preparation_data("tandem-spawn")
    preparation.pop("authkey", None)  # multiprocessing refuses to pickle it; unused here
    preparation = pickle.dumps(preparation)
    work = pickle.dumps((fn, tuple(args), backend))
    children, senders = _start(nprocs, store.port, backend)
    results: dict[int, Any] = {}
    try:
        for sender in senders:
            try:
                sender.send_bytes(preparation)
                sender.send_bytes(work)
            except OSError:
                pass  # it died at once; its exit says how
            sender.close()
        readers = {child.reader: rank for rank, child in enumerate(children)}
        while len(results) < nprocs:
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
                    raise SpawnError(rank, f"died before reporting ({describe(child.exitcode)})")
    finally:
        stop_processes([child.process for child in children])
        for child in children:
            child.close()
        del store
    return [results[rank] for rank in range(nprocs)]


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
