"""tandem: distributed training for PyTorch — data, pipeline and hybrid parallelism."""

from tandem.comm.checks import CollectiveMismatchError
from tandem.comm.collectives import (
    Handle,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    recv,
    reduce,
    reducescatter,
    send,
)
from tandem.comm.groups import Group, Mesh, mesh, new_group
from tandem.runtime import (
    World,
    device,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tandem.spawning import SpawnError, spawn

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "Group",
    "Handle",
    "Mesh",
    "SpawnError",
    "World",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "device",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mesh",
    "new_group",
    "rank",
    "recv",
    "reduce",
    "reducescatter",
    "send",
    "shutdown",
    "size",
    "spawn",
]
