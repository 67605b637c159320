"""`td.spawn`: run a function on N local processes that have joined one job.

The notebook and test pattern: a one-shot use of the local worker pool (`launch.local.pool`,
which `tandem.testing`'s shared worlds keep alive). Each child is started as `tandem run`
starts its ranks, made like the parent (what `multiprocessing`'s spawn start method gives it:
our `sys.path`, directory and main module, so that `fn` may live in the calling script), runs
`td.init()`, then `fn(*args)`. The first child that raises or dies stops the others, and its
rank and traceback are re-raised in the parent as `SpawnError`; a child that died before
reporting (a crash, an import error) brings its last lines of output instead.

`fn` and `args` travel with cloudpickle: a function defined in a notebook cell or in
`python -c` lives in a `__main__` that has no file, so the child cannot import it by name
(plain pickle's `Can't get attribute 'run' on <module '__main__'>`); cloudpickle sends such a
function by value and importable ones by name, as pickle does. Forking instead would copy a
parent that runs threads (a Jupyter kernel's, torch's thread pools) with their locks in
whatever state they were, a known source of hangs in the child; fresh processes started
from the same interpreter have none of that. The children's output is `[rank] `-prefixed into
ours, as under `tandem run`: in a notebook their prints appear in the cell that called `spawn`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.launch.local.pool import WorkerFailed, WorkerPool, work_message
from tandem.launch.local.processes import STOP_GRACE_S

# How long a reported error waits for a peer death that would explain it.
_CAUSE_GRACE_S = 3.0


class SpawnError(RuntimeError):
    """A child process raised or died; `rank` says which, the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


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
    from tandem import runtime

    work = work_message(fn, tuple(args), "td.spawn")
    try:
        pool = WorkerPool(nprocs, runtime.init, runtime.shutdown, backend=backend, like_parent=True)
    except WorkerFailed as failed:
        raise SpawnError(failed.rank or 0, failed.detail) from None
    try:
        reports = pool.collect(work, grace=_CAUSE_GRACE_S, last=True)
    finally:
        pool.close(grace=STOP_GRACE_S)
    if reports.errors:
        rank, first = reports.cause(), next(iter(reports.errors))
        then = f"\nrank {first} then failed with:\n{reports.errors[first]}" if first != rank else ""
        raise SpawnError(rank, reports.errors[rank] + then) from None
    return [reports.results[rank] for rank in range(nprocs)]
