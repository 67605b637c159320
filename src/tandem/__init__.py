"""tandem: distributed training for PyTorch — data, pipeline and hybrid parallelism.

The public names are loaded on first use (PEP 562): `import tandem` defines them without
importing torch, so the `tandem` command (`--help`, `run`'s parent process, `doctor`) starts
fast, and `td.init`, `from tandem import allreduce` and the rest import what they need when
they are first touched. `_EXPORTS` says where each name lives. Importing it also registers
tandem's torch.distributed backends ("tandem", and "mpi" where torch has none) with torch, when
torch is imported (`hooks/torch_backends.py`), and the strategy "tandem" with Lightning's Trainer and
Fabric when `lightning` is imported (`hooks/lightning_strategy.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

from tandem.hooks import lightning_strategy as _lightning_hook
from tandem.hooks import torch_backends as _torch_hook

__version__ = "0.1.0"

# module -> the public names it defines
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tandem.checkpoint.checkpointer": ("CheckpointError", "Checkpointer", "load", "save"),
    "tandem.checkpoint.sharded": ("load_sharded", "save_sharded"),
    "tandem.comm.agreement.agree": ("CollectiveMismatchError", "DivergedError"),
    "tandem.comm.collectives.finite": ("all_finite",),
    "tandem.comm.collectives.user": ("Handle", "allgather", "allgather_object", "allreduce",
                                "alltoall", "barrier", "broadcast", "broadcast_object", "recv",
                                "reduce", "reducescatter", "send"),
    "tandem.comm.collectives.gather_scatter": ("gather", "scatter"),
    "tandem.comm.groups": ("Group", "Mesh", "mesh", "new_group"),
    "tandem.data": ("partition_dataset",),
    "tandem.metrics.logger": ("MetricLogger",),
    "tandem.metrics.average": ("Average", "progress"),
    "tandem.metrics.means": ("MetricMismatchError",),
    "tandem.diagnostics.replicas": ("ReplicaBufferWarning", "ReplicaMismatchError"),
    "tandem.diagnostics.steps": ("report",),
    "tandem.comm.watchdog.watched": ("PeerUnreachableError", "WatchdogTimeout"),
    "tandem.parallel.activation_checkpoint": ("checkpoint_wrapper",),
    "tandem.parallel.broadcast": ("broadcast_buffers", "broadcast_optimizer_state", "broadcast_parameters",
                                  "check_replicas"),
    "tandem.parallel.data_parallel.wrappers": ("DistributedDataParallel", "DistributedOptimizer"),
    "tandem.parallel.fully_shard": ("CPUOffloadPolicy", "MixedPrecisionPolicy", "clip_grad_norm_",
                                    "full_optimizer_state_dict", "full_state_dict",
                                    "fully_shard", "load_full_state_dict", "materialize"),
    "tandem.parallel.gradient_sync": ("no_sync", "set_requires_gradient_sync"),
    "tandem.parallel.data_parallel.join": ("join",),
    "tandem.parallel.data_parallel.local_sgd": ("LocalSGD",),
    "tandem.parallel.memory": ("MemoryComparison", "MemoryEstimate", "compare_memory", "estimate_memory"),
    "tandem.parallel.pipeline": ("Pipeline", "PipelineStats"),
    "tandem.parallel.data_parallel.samples": ("samples",),
    "tandem.parallel.data_parallel.step_check": ("ReplicaStartWarning",),
    "tandem.parallel.sync_bn": ("SyncBatchNorm",),
    "tandem.parallel.tensor": ("Branches", "ColumnParallelLinear", "ParallelSelfAttention",
                               "RowParallelLinear", "VocabParallelEmbedding", "parallelize",
                               "vocab_parallel_cross_entropy"),
    "tandem.parallel.zero.optimizer": ("ZeroOptimizer",),
    "tandem.runtime": ("World", "device", "init", "is_initialized", "local_rank", "local_size",
                       "rank", "shutdown", "size"),
    "tandem.spawning": ("SpawnError", "spawn"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
# public submodules reached as attributes: `td.functional.all_reduce(...)`
_SUBMODULES = ("elastic", "functional")

__all__ = [
    "Average",
    "Branches",
    "CPUOffloadPolicy",
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "ColumnParallelLinear",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DivergedError",
    "Group",
    "Handle",
    "LocalSGD",
    "MemoryComparison",
    "MemoryEstimate",
    "Mesh",
    "MetricLogger",
    "MetricMismatchError",
    "MixedPrecisionPolicy",
    "ParallelSelfAttention",
    "PeerUnreachableError",
    "Pipeline",
    "PipelineStats",
    "ReplicaBufferWarning",
    "ReplicaMismatchError",
    "ReplicaStartWarning",
    "RowParallelLinear",
    "SpawnError",
    "SyncBatchNorm",
    "VocabParallelEmbedding",
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
    "checkpoint_wrapper",
    "clip_grad_norm_",
    "compare_memory",
    "device",
    "elastic",
    "estimate_memory",
    "full_optimizer_state_dict",
    "full_state_dict",
    "fully_shard",
    "functional",
    "gather",
    "init",
    "is_initialized",
    "join",
    "load",
    "load_full_state_dict",
    "load_sharded",
    "local_rank",
    "local_size",
    "materialize",
    "mesh",
    "new_group",
    "no_sync",
    "parallelize",
    "partition_dataset",
    "progress",
    "rank",
    "recv",
    "reduce",
    "reducescatter",
    "report",
    "samples",
    "save",
    "save_sharded",
    "scatter",
    "send",
    "set_requires_gradient_sync",
    "shutdown",
    "size",
    "spawn",
    "vocab_parallel_cross_entropy",
]


# The one thing importing tandem does besides defining names: torch.distributed learns the
# backends "tandem" and "mpi" (now, or once torch is imported; see hooks/torch_backends.py).
_torch_hook.install()


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"tandem.{name}")  # the import binds it in globals()
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Last, once __getattr__ exists: with lightning already imported, registering imports
# tandem.lightning, which uses this package's lazy names.
_lightning_hook.install()
