"""`td.spawn`: run a function on N local processes that have joined one job.

The notebook and test pattern. The parent hosts the rendezvous store (so the port is free and
stays free), starts the children with the `spawn` start method, and waits for each child's
report. The first child that raises or dies stops the others, and its rank and traceback are
re-raised in the parent as `SpawnError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from tandem import rendezvous
from tandem.environments import tandem_variables
from tandem.launch.agent import describe

_STOP_GRACE_S = 3.0
# How long a reported error waits for a peer death that would explain it.
_CAUSE_GRACE_S = 3.0


class SpawnError(RuntimeError):
    """A child process raised or died; `rank` says which, the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


def _child(fn, args, variables, backend, conn) -> None:
    os.environ.update(variables)
    rank = int(variables["TANDEM_RANK"])
    import tandem as td

    try:
        td.init(backend=backend)
        result = fn(*args)
        conn.send(("ok", rank, result))
    except BaseException:
        conn.send(("err", rank, traceback.format_exc()))
    finally:
        td.shutdown()
        conn.close()


def stop_processes(processes: Sequence[mp.process.BaseProcess]) -> None:
    """SIGTERM, then SIGKILL whatever has not exited after a short grace."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(_STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join(_STOP_GRACE_S)


def _has_report(readers: dict, rank: int) -> bool:
    return any(r == rank and c.poll() for c, r in readers.items())


def _root_cause(processes, results, error: SpawnError) -> SpawnError:
    """A rank that died is the cause of its peers' errors ("connection reset"): prefer it.

    The peers notice a death before the parent does, so give the deaths a short deadline to
    show up before blaming the rank that merely reported first.
    """
    others = [p for r, p in enumerate(processes) if r != error.rank and r not in results]
    wait([p.sentinel for p in others], timeout=_CAUSE_GRACE_S)
    for rank, process in enumerate(processes):
        if process.exitcode not in (None, 0):
            return SpawnError(rank, f"{describe(process.exitcode)}; rank {error.rank} "
                                    f"then failed with:\n{error}")
    return error


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
    context = mp.get_context("spawn")
    processes, readers = [], {}
    for rank in range(nprocs):
        variables = tandem_variables(
            rank=rank, size=nprocs, local_rank=rank, local_size=nprocs,
            master_addr="127.0.0.1", master_port=store.port, backend=backend,
        )
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_child, args=(fn, tuple(args), variables, backend, writer), daemon=True
        )
        process.start()
        writer.close()
        processes.append(process)
        readers[reader] = rank
    results: dict[int, Any] = {}
    try:
        while len(results) < nprocs:
            ready = wait(list(readers) + [p.sentinel for p in processes if p.exitcode is None])
            for connection in [c for c in ready if c in readers]:
                rank = readers.pop(connection)
                try:
                    status, _, payload = connection.recv()
                except EOFError:
                    continue  # died before reporting: its exit code tells how
                if status == "err":
                    raise _root_cause(processes, results, SpawnError(rank, payload))
                results[rank] = payload
            for rank, process in enumerate(processes):
                if rank not in results and process.exitcode is not None and not _has_report(
                    readers, rank
                ):
                    raise SpawnError(
                        rank, f"died before reporting ({describe(process.exitcode)})"
                    )
    finally:
        stop_processes(processes)
        del store
    return [results[rank] for rank in range(nprocs)]
