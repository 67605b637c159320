"""The shared worlds of `tandem.testing` end cleanly: a closed world's ranks (mpiexec for MPI)
exit 0, after the engine's shutdown and MPI_Finalize, without the interpreter's seconds-long
teardown of torch; a world crowded with the threads of groups its tests left is started afresh."""

import importlib.util

import pytest

import tandem as td
from tandem.testing import MOST_THREADS, LocalWorld, get_world, still_running, threads

needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")


def rank():
    return td.rank()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=needs_mpi)])
def test_a_closed_world_exits_zero(backend):
    world = LocalWorld(2, backend)
    try:
        assert world.run(rank, timeout=60) == [0, 1]
        processes = list(world.processes)
        world.ask_to_stop()
        codes = [process.wait(timeout=30) for process in processes]
    finally:
        world.close()
    assert codes == [0] * len(processes), f"{backend} world's processes exited with {codes}"


def make_groups(count):
    """Gloo groups left undestroyed, as a test that makes groups may leave them."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(count)]
    return len(groups)


def test_a_world_crowded_with_left_groups_threads_is_started_afresh():
    env = {"HARNESS_TEST": "crowded"}  # a world of this test's own
    world = get_world(2, "gloo", env)
    before = dict(world.pids)
    assert not world.crowded(), {pid: threads(pid) for pid in before.values()}
    # each undestroyed Gloo group keeps threads on every rank: enough of them crowd the world
    world.run(make_groups, (MOST_THREADS // 2 + 5,), timeout=120)
    assert world.crowded(), {pid: threads(pid) for pid in before.values()}
    fresh = get_world(2, "gloo", env)  # (closed with the others at the session's end)
    assert fresh is not world and set(fresh.pids.values()).isdisjoint(before.values())
    assert not fresh.crowded()
    assert fresh.run(rank, timeout=60) == [0, 1]
    assert still_running(list(before.values()), timeout=30) == [], "the crowded world's ranks"
