"""tandem: distributed training for PyTorch — data, pipeline and hybrid parallelism.

The public names are loaded on first use (PEP 562): `import tandem` defines them without
importing torch, so the `tandem` command (`--help`, `run`'s parent process, `doctor`) starts
fast, and `td.init`, `from tandem import allreduce` and the rest import what they need when
they are first touched. `_EXPORTS` says where each name lives.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# module -> the public names it defines
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tandem.checkpoint": ("CheckpointError", "Checkpointer", "load", "save"),
    "tandem.comm.agreement": ("CollectiveMismatchError", "DivergedError"),
    "tandem.comm.finite": ("all_finite",),
    "tandem.comm.collectives": ("Handle", "allgather", "allgather_object", "allreduce",
                                "alltoall", "barrier", "broadcast", "broadcast_object", "recv",
                                "reduce", "reducescatter", "send"),
    "tandem.comm.groups": ("Group", "Mesh", "mesh", "new_group"),
    "tandem.data": ("partition_dataset",),
    "tandem.diagnostics.replicas": ("ReplicaBufferWarning", "ReplicaMismatchError", "check_replicas"),
    "tandem.diagnostics.steps": ("report",),
    "tandem.comm.watchdog": ("PeerUnreachableError", "WatchdogTimeout"),
    "tandem.parallel.broadcast": ("broadcast_buffers", "broadcast_optimizer_state", "broadcast_parameters"),
    "tandem.parallel.data_parallel": ("DistributedDataParallel", "DistributedOptimizer"),
    "tandem.parallel.join": ("join",),
    "tandem.parallel.local_sgd": ("LocalSGD",),
    "tandem.parallel.pipeline": ("Pipeline", "PipelineStats"),
    "tandem.parallel.step_check": ("ReplicaStartWarning",),
    "tandem.parallel.sync_bn": ("SyncBatchNorm",),
    "tandem.parallel.zero": ("ZeroOptimizer",),
    "tandem.runtime": ("World", "device", "init", "is_initialized", "local_rank", "local_size",
                       "rank", "shutdown", "size"),
    "tandem.spawning": ("SpawnError", "spawn"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DivergedError",
    "Group",
    "Handle",
    "LocalSGD",
    "Mesh",
    "Pipeline",
    "PipelineStats",
    "PeerUnreachableError",
    "ReplicaBufferWarning",
    "ReplicaMismatchError",
    "ReplicaStartWarning",
    "SpawnError",
    "SyncBatchNorm",
    "WatchdogTimeout",
    "World",
    "ZeroOptimizer",
    "all_finite",
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


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

