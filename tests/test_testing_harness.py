"""The shared worlds of `tandem.testing` end cleanly: a closed world's ranks (mpiexec for MPI)
exit 0, after the engine's shutdown and MPI_Finalize, without the interpreter's seconds-long
teardown of torch."""

import importlib.util

import pytest

import tandem as td
from tandem.testing import LocalWorld

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
