"""`td.spawn`: run a function on N local processes that have joined one job.

The notebook and test pattern. The parent hosts the rendezvous store (so the port is free and
stays free), starts the children with the `spawn` start method, and waits for each child's
report. The first child that raises or dies stops the others, and its rank and traceback are
re-raised in the parent as `SpawnError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from tandem import rendezvous
from tandem.environments import tandem_variables

_STOP_GRACE_S = 3.0


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


def describe_exit(code: int | None) -> str:
    """`exit code 3`, `killed by SIGKILL`: how a process ended, for people."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    try:
        while len(results) < nprocs:
            for ready in wait(list(readers) + list(sentinels)):
                if ready in readers:
                    rank = readers.pop(ready)
                    try:
                        status, _, payload = ready.recv()
                    except EOFError:
                        continue  # died before reporting: its sentinel tells how
                    if status == "err":
                        raise SpawnError(rank, payload)
                    results[rank] = payload
                elif ready in sentinels:
                    rank = sentinels.pop(ready)
                    processes[rank].join()
                    pending = [c for c, r in readers.items() if r == rank]
                    if pending and pending[0].poll():
                        continue  # its report is waiting to be read: handled next round
                    if rank not in results:
                        raise SpawnError(
                            rank, f"died before reporting ({describe_exit(processes[rank].exitcode)})"
                        )
    finally:
        stop_processes(processes)
        del store
    return [results[rank] for rank in range(nprocs)]
