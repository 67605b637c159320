"""`import tandem.horovod as hvd`: a drop-in for `horovod.torch` scripts.

Horovod's last release was in 2023 and it no longer builds against current PyTorch without
effort. This module keeps its names and semantics for PyTorch scripts and maps each one onto
tandem's own API, so the spellings Horovod needs (`allreduce_`, `allreduce_async_`, ...) live
here and nowhere else. Handles are tandem `Handle`s; `synchronize(h)` and `poll(h)` accept them.

Differences worth knowing: `Adasum` is not provided; `process_set=` is not supported (use
tandem groups); `gradient_predivide_factor` only changes where the division happens in
Horovod, which for the average it computes is the same result, so it is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import tandem as td
from tandem.comm.collectives import Handle

# Reduction ops, Horovod's names for tandem's.
Average = "mean"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"


class Compression:
    """Wire compression for gradients: `Compression.none` or `Compression.fp16`."""

    none = None
    fp16 = "fp16"
    bf16 = "bf16"


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (`td.init()`); Horovod's `comm` and `process_sets` are not supported."""
    if comm is not None or process_sets is not None:
        raise ValueError("tandem.horovod.init() takes no comm/process_sets: use td.new_group")
    td.init()


def shutdown() -> None:
    td.shutdown()


def is_initialized() -> bool:
    return td.is_initialized()


rank, size, local_rank, local_size = td.rank, td.size, td.local_rank, td.local_size


def cross_rank() -> int:
    """Which node this rank is on (ranks are laid out node by node)."""
    return td.rank() // td.local_size()


def cross_size() -> int:
    """How many nodes the job spans."""
    return td.size() // td.local_size()


def _op(average: bool | None, op: str | None) -> str:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated in Horovod) or op=, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op


class _Scaled:
    """A handle whose result is multiplied by `factor` once, when first waited for."""

    def __init__(self, handle: Handle, factor: float) -> None:
        self._handle, self._factor, self._result = handle, factor, None

    def done(self) -> bool:
        return self._handle.done()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._handle.wait().mul_(self._factor)
        return self._result


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> Handle:
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    handle = td.allreduce(tensor, op=_op(average, op), inplace=True, async_op=True)
    return handle if postscale_factor == 1.0 else _Scaled(handle, postscale_factor)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> Handle:
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    wire = tensor
    if compression == Compression.fp16 and tensor.is_floating_point():
        wire = tensor.to(torch.float16)
    result = allreduce_(wire.clone(), average, name, op, prescale_factor, postscale_factor)
    return result.to(tensor.dtype)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average=None, name=None, op=None,
                      **_: Any) -> list[torch.Tensor]:
    handles = [td.allreduce(t, op=_op(average, op), async_op=True) for t in tensors]
    return [h.wait() for h in handles]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None,
                       **_: Any) -> list[torch.Tensor]:
    handles = [td.allreduce(t, op=_op(average, op), inplace=True, async_op=True) for t in tensors]
    return [h.wait() for h in handles]


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    return td.allgather(tensor, async_op=True)


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    return td.allgather(tensor)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    return td.broadcast(tensor, root=root_rank, inplace=True, async_op=True)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    return td.broadcast(tensor, root=root_rank, async_op=True)


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    return td.broadcast(tensor, root=root_rank, inplace=True)


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    return td.broadcast(tensor, root=root_rank)


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Returns `(output, received_splits)`, as Horovod ≥ 0.24 does."""
    n = td.size()
    rows = tensor.shape[0]
    if splits is None:
        splits = torch.full((n,), rows // n, dtype=torch.int64)
    splits = torch.as_tensor(splits, dtype=torch.int64)
    received = td.alltoall(splits.clone(), splits=[1] * n)
    return td.alltoall(tensor, splits=splits.tolist()), received


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=None) -> torch.Tensor:
    return td.reducescatter(tensor, op=op)


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the async operation has completed."""
    return handle.done()


def barrier(process_set=None) -> None:
    td.barrier()


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    return td.broadcast_object(obj, root=root_rank)


def allgather_object(obj, name=None, process_set=None) -> list:
    return td.allgather_object(obj)


def broadcast_parameters(params, root_rank: int) -> None:
    """`model.state_dict()` or `model.named_parameters()`, as Horovod accepts both."""
    if not isinstance(params, dict):
        params = dict(params)
    td.broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    td.broadcast_optimizer_state(optimizer, root=root_rank)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Horovod's signature over `td.DistributedOptimizer` (a wrapper object, not a subclass)."""
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=Average or Sum, not {op!r}")
    return td.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, op=op, compression=compression,
        accumulate=backward_passes_per_step,
    )


def join(device: int = -1) -> int:
    """After the loop: keep answering the others' reductions until every rank has run out of
    data; returns the last rank to join (Horovod's semantics: ranks out of data count as zero
    gradients)."""
    return td.join()


# Horovod's module, tandem's implementation: the same layer under Horovod's name.
SyncBatchNorm = td.SyncBatchNorm
