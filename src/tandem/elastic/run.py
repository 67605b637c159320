"""`td.elastic.run`: the retry loop of an elastic job's training function.

    @td.elastic.run
    def train(state):
        while state.step < steps:
            ...one step...
            state.step += 1
            state.commit()

    train(td.elastic.State(model=model, optimizer=opt, step=0))

Each pass first puts every rank on the newest committed state (`State.sync`), then calls the
function. When a peer dies (`PeerUnreachableError`, or the watchdog's timeout) the rank waits
for the launcher's next round, leaves the broken world and joins the new one
(`runtime.rejoin`); when a commit finds that workers joined (`WorldChanged`), it does the same
at once. The wrappers given to the state (`td.DistributedOptimizer`,
`td.DistributedDataParallel`) then reduce over the new world, and the state's reset callbacks
run. Rank 0 prints one line per change: the worlds, why, the commit it resumed from, and the
seconds lost since the event.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from tandem import runtime
from tandem.comm.watchdog.watched import PeerUnreachableError, WatchdogTimeout
from tandem.elastic.state import State, WorldChanged
from tandem.parallel.layout.owner import owner_of
from tandem.rendezvous import elastic_rounds

FAILURES = (PeerUnreachableError, WatchdogTimeout)  # what a lost peer looks like to a rank


def run(train: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `train(state, *args, **kwargs)` so that it survives changes of world.

    When a peer is lost (or ranks join), each surviving rank leaves the old world, joins the
    launcher's next round, restores `state` from its last commit (or keeps it, when a commit
    saw the change) and calls `train` again.

    Args:
        train: the training function; it takes a `td.elastic.State` first and commits it as it
            goes.

    Returns:
        The decorated function: `elastic(state, *args, **kwargs)` returns what `train` returns.

    Raises:
        TypeError: (when called) its first argument is not a `td.elastic.State`.
        RuntimeError: (when called) `td.init()` was not called, or the job was started with a
            fixed world (plain mpiexec, torchrun) that cannot resize: use `tandem run --min-np A
            --max-np B` (on MPI: `tandem run --backend mpi --min-np A`, Open MPI with ULFM).
        PeerUnreachableError: (when called) a peer was lost and the launcher formed no next
            round within the timeout.
        WatchdogTimeout: (when called) as PeerUnreachableError, for a peer that stopped
            answering.
    """

    @functools.wraps(train)
    def elastic(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"{train.__name__} under td.elastic.run takes a td.elastic.State "
                            f"first, got {type(state).__name__}")
        if not _resizable():
            state.sync()
            return train(state, *args, **kwargs)
        if runtime.shrinks():
            return _shrinking(train, state, args, kwargs)
        before: tuple[int, int] | None = None  # (size, commits) before the change
        rollback = True  # False when a commit saw the change: the state is its snapshot
        while True:
            state._round = runtime.state().job.elastic.round
            try:  # a peer may die while the state is sent too
                if before is not None:
                    state.rejoin_wrappers()
                state.sync(rollback, changed=before is not None)
                if before is not None:
                    _say_resumed(state, before)
                    for callback in state._reset_callbacks:
                        callback()
                return train(state, *args, **kwargs)
            except WorldChanged:
                rollback = False
            except FAILURES as error:
                rollback = True
                _name_the_silent(state, error)
                if state.commits == 0:
                    state.warn_no_commit()
                _await_next_round(state, error)
            before = (runtime.size(), state.commits)
            _leave(state)
            runtime.rejoin()

    return elastic


def _shrinking(train: Callable[..., Any], state: State, args: tuple, kwargs: dict) -> Any:
    """`run` on an MPI world that shrinks (`tandem run --backend mpi --min-np`, Open MPI's
    ULFM): a collective that fails because a rank failed (`rank_failed`) makes every survivor
    let go of the old world's operations, shrink the world to the ranks alive
    (`runtime.shrink`) and restore the last commit. A rank that stopped answering (stopped,
    hung) has not failed for MPI: a watchdog timeout that names it silent is reported to the
    agent, which kills it, and the world then shrinks the same way. Nobody can join an MPI
    world, so it only ever shrinks; the launcher stops the job below --min-np."""
    from tandem.comm.engines.mpi_backend import rank_failed

    change = None  # (size, commits, seconds) before the last shrink, the ranks lost, why
    workers = list(range(runtime.size()))  # each rank's worker (its first rank, which it keeps)
    state.follow_workers(workers)  # a peer backup names each part's owner by worker
    while True:
        try:
            if change is not None:
                state.rejoin_wrappers()
            state.sync(rollback=True, changed=change is not None)
            if change is not None:
                _say_shrunk(state, *change)
                for callback in state._reset_callbacks:
                    callback()
            return train(state, *args, **kwargs)
        except WatchdogTimeout as error:
            silent = _silent_of(error)
            if not silent or not _report_silent(silent, workers):
                raise
            # the agent kills the silent ranks: then the world can shrink without them
            why = (f"rank(s) {', '.join(map(str, silent))} did not answer rank "
                   f"{runtime.rank()}'s watchdog and were stopped")
        except (RuntimeError, TimeoutError) as error:
            if not rank_failed(error):
                raise
            why = str(error).splitlines()[0]
        if state.commits == 0:
            state.warn_no_commit()
        before = (runtime.size(), state.commits, time.monotonic())
        _leave(state, collect=False)  # ULFM's revoke already released the peers
        lost = runtime.shrink()
        workers = [worker for rank, worker in enumerate(workers) if rank not in lost]
        state.follow_workers(workers)
        change = (before, lost, why)


def _silent_of(error: BaseException | None) -> tuple[int, ...]:
    """The ranks a watchdog timeout named as silent, also when a caller re-raised it in its own
    words (the data-parallel step's check does: its error's context is the watchdog's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "silent", ()):
            return tuple(error.silent)
        error = error.__cause__ or error.__context__
    return ()


def _report_silent(silent: tuple[int, ...], workers: list[int]) -> bool:
    """Name the ranks that did not answer this rank's watchdog to the agent, which kills them
    (`launch/mpi/shrinking.py`): a stopped or hung rank is not failed for MPI, and the world
    cannot shrink around it. False without the agent's store (plain mpiexec)."""
    from tandem.launch.mpi.fault_tolerance import SILENT_COUNT, silent_key
    from tandem.rendezvous import StoreClient

    current = runtime.state()
    job = current.job
    if job.master_port is None:
        return False
    store = StoreClient(job.master_addr or "127.0.0.1", job.master_port, job.store_key,
                        current.timeout)
    try:
        number = store.add(SILENT_COUNT, 1)
        store.set(silent_key(number), json.dumps({
            "workers": [workers[rank] for rank in silent], "by": workers[runtime.rank()],
            "waited": current.timeout}))
    finally:
        store.close()
    return True


def _say_shrunk(state: State, before: tuple[int, int, float], lost: tuple[int, ...],
                why: str) -> None:
    if runtime.rank() != 0:
        return
    size, commits, since = before
    redone = f", {commits - state.commits} commit(s) redone" if commits > state.commits else ""
    step = state._extras.get("step")
    at = f" (step {step})" if isinstance(step, int) else ""
    ranks = ", ".join(map(str, lost)) or "none named"
    print(f"tandem elastic: world {size} -> {runtime.size()} (the MPI world shrank without "
          f"rank(s) {ranks}: {why}); resumed from commit {state.commits}{at}{redone}, "
          f"{time.monotonic() - since:.2f} s after the failure", file=sys.stderr, flush=True)


def _leave(state: State, collect: bool = True) -> None:
    """Let go of everything that holds the old world's engine (the wrappers' operations in
    flight), so that leaving it closes its connections: peers blocked on this rank then fail
    at once instead of at their timeout. (`collect=False` on MPI: the revoke released them,
    and the collection took 0.5-1 s of the 0.6-1.1 s from a lost rank to the resumed state.)"""
    for wrapper in (state.model, state.optimizer):
        owner_of(wrapper).leave()  # parallel/layout/owner.py: each split knows what it holds
    if collect:
        gc.collect()  # works caught in reference cycles (autograd's) go now, not at some later gc


def _resizable() -> bool:
    """Whether this job can change its world; an error where td.elastic cannot work."""
    if not runtime.is_initialized():
        raise RuntimeError("td.elastic.run: call td.init() first")
    job = runtime.state().job
    if job.elastic is not None or runtime.shrinks():
        return True
    if runtime.size() == 1 and job.source in ("single", "manual", "tandem"):
        return False  # one process: nothing can leave or join; the function just runs
    raise RuntimeError(
        f"td.elastic.run needs a launcher that can resize the job: this one was started by "
        f"{job.source} with a fixed world of {runtime.size()} (an MPI world cannot change once "
        f"started; started by `tandem run --backend mpi --min-np A` on Open MPI with ULFM, it "
        f"can shrink). Start it with `tandem run --min-np A --max-np B script.py` (Gloo), or "
        f"use a fixed -np with --max-restarts and td.Checkpointer")


def _name_the_silent(state: State, error: Exception) -> None:
    """A timeout whose peers did not even answer the watchdog: those are stuck (stopped, hung,
    deadlocked), not this rank; the launcher drops them and forms the round without them."""
    silent = _silent_of(error)  # also when a check re-raised the timeout in its own words
    if silent:
        elastic_rounds.report_silent(state._store, state._round, silent, runtime.rank(),
                                     runtime.state().timeout)


def _await_next_round(state: State, error: Exception) -> None:
    """Wait for the launcher to form the round without the lost peer; the error itself when
    it never does (the peer is alive but stuck, or the launcher is gone)."""
    deadline = time.monotonic() + runtime.state().timeout
    while state._look() == state._round:
        if time.monotonic() >= deadline:
            raise error
        try:  # the next round's key appears as the launcher publishes it
            state._store.wait([elastic_rounds.record_key(state._round + 1)],
                              timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            pass


def _say_resumed(state: State, before: tuple[int, int]) -> None:
    if runtime.rank() != 0:
        return
    size, commits = before
    joined = elastic_rounds.read(state._store, state._round)
    lost = time.time() - joined.since
    redone = f", {commits - state.commits} commit(s) redone" if commits > state.commits else ""
    step = state._extras.get("step")  # the training's own count, when the state keeps one
    at = f" (step {step})" if isinstance(step, int) else ""
    print(f"tandem elastic: world {size} -> {runtime.size()} (round {joined.number}: "
          f"{joined.why}); resumed from commit {state.commits}{at}{redone}, {lost:.2f} s after "
          f"the event", file=sys.stderr, flush=True)
