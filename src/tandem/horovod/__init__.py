"""`import tandem.horovod as hvd`: a drop-in for `horovod.torch` scripts.

Horovod's last release was in 2023 and it no longer builds against current PyTorch without
effort. This package keeps its names and semantics for PyTorch scripts and maps each one onto
tandem's own API, so the spellings Horovod needs (`allreduce_`, `allreduce_async_`, ...) live
here and nowhere else:

- `basics`: init and the world, build queries, error types, process sets (`td.new_group`),
  reduction ops and compression;
- `engine`: handles, posting order, `name=`, and `join` (how a joined rank answers);
- `ops`: the collectives, differentiable through `tandem.functional`;
- `optimizer`: `DistributedOptimizer` and the state broadcasts;
- `timeline`: `start_timeline` / `stop_timeline`, Horovod's trace of its operations.

What differs from Horovod is listed in the README's Horovod section.
"""

from __future__ import annotations

import tandem as td
from tandem.horovod import elastic, engine
from tandem.horovod.basics import (
    Adasum,
    Average,
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    HorovodInternalError,
    HorovodMismatchError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    NoneCompressor,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    gpu_available,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    size,
)
from tandem.horovod.basics import init as _init
from tandem.horovod.basics import shutdown as _shutdown
from tandem.horovod.engine import poll, synchronize
from tandem.horovod.ops import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    sparse_allreduce_async,
)
from tandem.horovod.optimizer import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from tandem.horovod.scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from tandem.horovod.timeline import start_timeline, stop_timeline


def init(comm=None, process_sets=None) -> None:
    """Join the job (`td.init()`); `process_sets` (lists of ranks) are added right away."""
    _init(comm, process_sets)


def shutdown() -> None:
    """Leave the job; operations posted and never synchronized are dropped."""
    stop_timeline()
    engine.forget()
    _shutdown()


# Horovod's module, tandem's implementation: the same layer under Horovod's name.
SyncBatchNorm = td.SyncBatchNorm
# Not Horovod's own (it wraps optimizers), but scripts written for it reach for torch's wrapper
# under the hvd name (`model = hvd.DistributedDataParallel(model)`): tandem's, which averages
# gradients during backward exactly as hvd.DistributedOptimizer does.
DistributedDataParallel = td.DistributedDataParallel

__all__ = [
    "Adasum", "Average", "BF16Compressor", "Compression", "Compressor", "DistributedDataParallel",
    "DistributedOptimizer",
    "FP16Compressor", "HorovodInternalError", "HorovodMismatchError", "HostsUpdatedInterrupt",
    "Max", "Min", "NoneCompressor", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled", "global_process_set",
    "gpu_available", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize",
]
