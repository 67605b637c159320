"""tandem: distributed training for PyTorch — data, pipeline and hybrid parallelism."""

from tandem.checkpoint import Checkpointer, CheckpointError, load, save
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
from tandem.data import partition_dataset
from tandem.diagnostics.replicas import ReplicaBufferWarning, ReplicaMismatchError, check_replicas
from tandem.diagnostics.steps import report
from tandem.diagnostics.watchdog import PeerUnreachableError, WatchdogTimeout
from tandem.parallel.broadcast import broadcast_buffers, broadcast_optimizer_state, broadcast_parameters
from tandem.parallel.data_parallel import DistributedDataParallel, DistributedOptimizer
from tandem.parallel.join import join
from tandem.parallel.local_sgd import LocalSGD
from tandem.parallel.pipeline import Pipeline, PipelineStats
from tandem.parallel.sync_bn import SyncBatchNorm
from tandem.parallel.zero import ZeroOptimizer
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
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "Group",
    "Handle",
    "LocalSGD",
    "Mesh",
    "Pipeline",
    "PipelineStats",
    "PeerUnreachableError",
    "ReplicaBufferWarning",
    "ReplicaMismatchError",
    "SpawnError",
    "SyncBatchNorm",
    "WatchdogTimeout",
    "World",
    "ZeroOptimizer",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_buffers",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_replicas",
    "device",
    "init",
    "is_initialized",
    "join",
    "load",
    "local_rank",
    "local_size",
    "mesh",
    "new_group",
    "partition_dataset",
    "rank",
    "recv",
    "reduce",
    "reducescatter",
    "report",
    "save",
    "send",
    "shutdown",
    "size",
    "spawn",
]
