"""The one local worker pool under `td.spawn` and `tandem.testing`'s shared worlds
(`launch.local.pool`): results in rank order from reused workers, the rank that raised, died or
hung named with its traceback, exit, last output or stacks, a failed start named, nothing left
running. The workers here run no torch and no engine (their setup is a plain function), so a
pool starts in a fraction of a second; `td.spawn` (tests/test_runtime.py, test_notebook.py) and
the shared worlds (every `run_distributed` test, test_testing_harness.py) cover td.init."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import pytest

from tandem.launch.local.pool import WorkerFailed, WorkerPool, work_message
from tandem.testing import mpiexec_command, still_running

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
LAUNCHERS = ["local", pytest.param("mpiexec", marks=pytest.mark.skipif(not HAVE_MPI, reason="no MPI"))]


def nothing():
    pass


def where():
    """This worker's place as the pool gave it (rank, size, threads) and its pid."""
    return (os.environ.get("TANDEM_RANK"), os.environ.get("TANDEM_SIZE"),
            os.environ.get("OMP_NUM_THREADS"), os.getpid())


def raise_on(rank: int):
    if os.environ["TANDEM_RANK"] == str(rank):
        raise KeyError("missing-key")
    return "fine"


def die_on(rank: int):
    if os.environ["TANDEM_RANK"] == str(rank):
        sys.stderr.write(f"rank {rank} cannot go on: disk full\n")
        sys.stderr.flush()
        os._exit(3)
    raise ConnectionError("my peer is gone")


def hang_on(rank: int):
    if os.environ["TANDEM_RANK"] == str(rank):
        threading.Event().wait(120)  # a stuck rank: it never answers within the pool's timeout
    return "fine"


def setup_failing_on_rank_1():
    if os.environ["TANDEM_RANK"] == "1":
        raise ValueError("no such backend: 'glue'")


def setup_dying_on_rank_1():
    if os.environ["TANDEM_RANK"] == "1":
        print("importing the world", flush=True)
        os._exit(5)


def setup_hanging_on_rank_1():
    hang_on(1)


def pool_of(size: int, **options) -> WorkerPool:
    return WorkerPool(size, options.pop("setup", nothing), nothing,
                      env={**os.environ, "OMP_NUM_THREADS": "1"}, **options)


def run(pool: WorkerPool, fn, *args, timeout: float = 60.0):
    return pool.collect(work_message(fn, args, "this test"), timeout=timeout, grace=10.0)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_results_come_in_rank_order_from_the_same_workers_and_nothing_is_left(launcher):
    pool = pool_of(3, launcher=mpiexec_command(3) if launcher == "mpiexec" else ())
    try:
        first, second = run(pool, where), run(pool, where)
    finally:
        pids = list(pool.pids.values())
        pool.close()
    assert not first.errors and list(first.results) != [] and first.results == second.results
    places = [first.results[rank] for rank in range(3)]
    if launcher == "local":  # the one rank-environment builder's variables
        assert [place[:3] for place in places] == [(str(r), "3", "1") for r in range(3)]
    assert len({place[3] for place in places} | {os.getpid()}) == 4  # three workers, not us
    assert still_running(pids, timeout=10) == []


def test_the_rank_that_raised_is_named_with_its_traceback_and_the_pool_goes_on():
    pool = pool_of(2)
    try:
        failed = run(pool, raise_on, 1)
        assert (failed.results, list(failed.errors), failed.died) == ({0: "fine"}, [1], set())
        assert failed.cause() == 1 and "KeyError: 'missing-key'" in failed.errors[1]
        assert "raise_on" in failed.errors[1]  # the rank's own traceback
        assert run(pool, raise_on, 2).results == {0: "fine", 1: "fine"}  # same workers, no error
    finally:
        pool.close()


def test_a_rank_that_died_is_the_cause_with_its_exit_and_last_output():
    pool = pool_of(2)
    try:
        failed = run(pool, die_on, 1)
    finally:
        pool.close()
    assert failed.died == {1} and sorted(failed.errors) == [0, 1], failed
    assert failed.cause() == failed.cause(min) == 1  # blamed over its peer, whoever spoke first
    assert "died before reporting (exit code 3)" in failed.errors[1], failed.errors[1]
    assert "rank 1 cannot go on: disk full" in failed.errors[1].split("its last output:")[1]
    assert "ConnectionError: my peer is gone" in failed.errors[0]


def test_a_rank_that_does_not_answer_is_pending_and_its_stacks_are_dumped():
    pool = pool_of(2)
    try:
        stuck = run(pool, hang_on, 1, timeout=3.0)
        assert (stuck.results, stuck.errors, stuck.pending) == ({0: "fine"}, {}, [1])
        stacks = pool.dump_stacks(stuck.pending)
    finally:
        pool.close()
    assert "rank 1's last output:" in stacks and "in hang_on" in stacks, stacks


@pytest.mark.parametrize("setup, said", [
    (setup_failing_on_rank_1, "ValueError: no such backend: 'glue'"),
    (setup_dying_on_rank_1, "rank 1 exited while starting (exit code 5)"),
])
def test_a_rank_that_fails_its_setup_is_named_and_nothing_is_left(setup, said):
    before = set(threading.enumerate())
    with pytest.raises(WorkerFailed) as raised:
        pool_of(2, setup=setup)
    assert raised.value.rank == 1 and said in str(raised.value), raised.value
    if setup is setup_dying_on_rank_1:
        assert "importing the world" in str(raised.value).split("last output:")[1]
    # the output threads are done: every worker is gone and its pipes drained
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("tandem-rank")]


def test_a_rank_that_never_gets_ready_fails_the_start_within_its_deadline():
    with pytest.raises(WorkerFailed, match=r"of 2 ranks started within 5 s") as raised:
        pool_of(2, setup=setup_hanging_on_rank_1, start_timeout=5.0)
    assert raised.value.rank is None


def test_what_cannot_be_pickled_is_named_before_any_process_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="this test cannot send the variable 'lock' that fn "
                                        "closes over .*_thread.lock"):
        work_message(lambda: lock.locked(), (), "this test")
