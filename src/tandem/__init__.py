"""tandem: distributed training for PyTorch — data, pipeline and hybrid parallelism.

tandem 1.0's public API: about fifty names at the top (`__all__`: joining a job, the collectives,
groups and meshes, data, the ways to split a model, the model-wide calls that work for any split,
checkpoints, spawning, the errors users catch), and namespaces for the rest: `td.tensor`,
`td.pipeline`, `td.fsdp`, `td.context`, `td.memory`, `td.checkpoint`, `td.metrics`, `td.errors`
(every error and warning), `td.functional`, `td.elastic`. A 0.x name that moved into a namespace
(`td.ColumnParallelLinear`) still works until 1.1, with one FutureWarning naming the new spelling.

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

# module -> the public names it defines (tandem 1.0's top level)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tandem.checkpoint.checkpointer": ("CheckpointError", "Checkpointer", "load", "save"),
    "tandem.comm.agreement.agree": ("CollectiveMismatchError", "DivergedError"),
    "tandem.comm.collectives.finite": ("all_finite",),
    "tandem.comm.collectives.user": ("Handle", "allgather", "allgather_object", "allreduce",
                                     "alltoall", "barrier", "broadcast", "broadcast_object", "recv",
                                     "reduce", "reducescatter", "send"),
    "tandem.comm.collectives.gather_scatter": ("gather", "scatter"),
    "tandem.comm.groups": ("Group", "Mesh", "mesh", "new_group"),
    "tandem.comm.watchdog.watched": ("PeerUnreachableError", "WatchdogTimeout"),
    "tandem.data": ("partition_dataset",),
    "tandem.checkpoint.preemption": ("preempted",),
    "tandem.parallel.broadcast": ("broadcast_buffers", "broadcast_optimizer_state",
                                  "broadcast_parameters", "check_replicas"),
    "tandem.parallel.data_parallel.join": ("join",),
    "tandem.parallel.data_parallel.local_sgd": ("LocalSGD",),
    "tandem.parallel.data_parallel.samples": ("samples",),
    "tandem.parallel.data_parallel.wrappers": ("DistributedDataParallel", "DistributedOptimizer"),
    "tandem.parallel.fully_shard": ("clip_grad_norm_", "fully_shard"),
    "tandem.parallel.gradient_sync": ("no_sync",),
    "tandem.parallel.pipeline": ("Pipeline",),
    "tandem.parallel.state_dict": ("get_state_dict", "set_state_dict"),
    "tandem.parallel.sync_bn": ("SyncBatchNorm",),
    "tandem.parallel.tensor": ("parallelize",),
    "tandem.parallel.zero.optimizer": ("ZeroOptimizer",),
    "tandem.runtime": ("World", "device", "init", "is_initialized", "local_rank", "local_size",
                       "rank", "shutdown", "size"),
    "tandem.spawning": ("spawn",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
# the sub-namespaces, reached as attributes (`td.fsdp.MixedPrecisionPolicy`) or imported
# (`from tandem.fsdp import MixedPrecisionPolicy`); each is a module of its own, loaded on first use
_NAMESPACES = ("checkpoint", "context", "elastic", "errors", "fsdp", "functional", "memory", "metrics",
               "pipeline", "tensor")
# tandem 0.x's top-level names that moved into a namespace: still found, for one release, with a
# FutureWarning naming the new spelling (once per name; see __getattr__)
_MOVED: dict[str, str] = {
    **dict.fromkeys(("load_sharded", "save_sharded"), "checkpoint"),
    **dict.fromkeys(("ReplicaBufferWarning", "ReplicaMismatchError", "ReplicaStartWarning",
                     "SpawnError"), "errors"),
    **dict.fromkeys(("CPUOffloadPolicy", "MixedPrecisionPolicy", "full_optimizer_state_dict",
                     "full_state_dict", "load_full_state_dict", "materialize",
                     "set_requires_gradient_sync"), "fsdp"),
    **dict.fromkeys(("MemoryComparison", "MemoryEstimate", "checkpoint_wrapper", "compare_memory",
                     "estimate_memory"), "memory"),
    **dict.fromkeys(("Average", "MetricLogger", "MetricMismatchError", "progress", "report"),
                    "metrics"),
    "PipelineStats": "pipeline",
    **dict.fromkeys(("Branches", "ColumnParallelLinear", "ParallelSelfAttention", "RowParallelLinear",
                     "VocabParallelEmbedding", "vocab_parallel_cross_entropy"), "tensor"),
}

# What `from tandem import *` binds: the functions and classes above. The namespaces are left out
# (a star import should not import ten modules, torch's heavy ones among them); `dir(tandem)`
# lists them.
__all__ = [
    # joining a job
    "World", "device", "init", "is_initialized", "local_rank", "local_size", "rank", "shutdown",
    "size", "spawn",
    # collectives (in place and returned; torch's keyword names accepted)
    "Handle", "all_finite", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_object", "gather", "recv", "reduce", "reducescatter", "scatter", "send",
    # groups and meshes
    "Group", "Mesh", "mesh", "new_group",
    # data
    "partition_dataset", "samples",
    # the ways to split a model
    "DistributedDataParallel", "DistributedOptimizer", "LocalSGD", "Pipeline", "SyncBatchNorm",
    "ZeroOptimizer", "fully_shard", "parallelize",
    # model-wide calls, for any split
    "broadcast_buffers", "broadcast_optimizer_state", "broadcast_parameters", "check_replicas",
    "clip_grad_norm_", "get_state_dict", "join", "no_sync", "set_state_dict",
    # checkpoints, and the preemption that asks for one
    "Checkpointer", "load", "preempted", "save",
    # the errors users catch (every one: td.errors)
    "CheckpointError", "CollectiveMismatchError", "DivergedError", "PeerUnreachableError",
    "WatchdogTimeout",
]


# The one thing importing tandem does besides defining names: torch.distributed learns the
# backends "tandem" and "mpi" (now, or once torch is imported; see hooks/torch_backends.py).
_torch_hook.install()


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f"tandem.{name}")  # the import binds it in globals()
    module = _HOME.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _MOVED:
        value = _moved(name)
    else:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function (a moved name warns once)
    return value


def _moved(name: str) -> Any:
    """A 0.x top-level name, from its 1.0 namespace, with a FutureWarning at the user's line."""
    import warnings

    namespace = _MOVED[name]
    # stacklevel 3: the line that wrote `td.<name>` or `from tandem import <name>`, above
    # __getattr__ and this function
    warnings.warn(f"td.{name} is td.{namespace}.{name} in tandem 1.0; the old name goes in 1.1",
                  FutureWarning, stacklevel=3)
    return getattr(importlib.import_module(f"tandem.{namespace}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_NAMESPACES))


# Last, once __getattr__ exists: with lightning already imported, registering imports
# tandem.lightning, which uses this package's lazy names.
_lightning_hook.install()
