"""A fully sharded unit's gradient on its way to the shard: reduce-scatter, then (HSDP) the
replicas' all-reduce, then the mean in the shard's `.grad`.

`start` is called from the unit's backward with the gradient of the whole unit: with gradient
sync off it is accumulated (in the shard's dtype); else it is cast to `reduce_dtype`
(`MixedPrecisionPolicy`), packed with two more elements per shard, a flag (whether this rank saw
inf/NaN: every rank puts inf into its shard's gradient when any did, so GradScaler skips the
same step everywhere) and this rank's weight, and reduce-scattered (sum) over the shard group,
asynchronously. At the end of backward `to_replicas` waits for it and starts the all-reduce
over the replicas (HSDP), and `finish` waits for that and writes sum / (summed weights) into
the shard's `.grad`, in the shard's dtype and memory (the host when offloaded).

The weight is 1 (the summed weights: ranks x replicas, the mean), or on an uneven step of
`td.partition_dataset(pad=False)` / `td.samples(n)` this rank's samples, by which its gradient
is then multiplied: the one-process mean over all samples (`data_parallel/samples.py`). With
gradient sync off (accumulation) each pass's gradient is multiplied by its own weight as it
joins the accumulated one, and the weight sent is their mean: each micro-batch counts as one
process following torch's recipe (each micro-batch's mean loss / M) counts it.

The packed input is the unit's whole gradient: were every unit's kept until the end of
backward, a step would hold the whole model's gradient, unsharded. So at most
`MAX_IN_FLIGHT` reduce-scatters are outstanding (FSDP2 keeps about as many): starting one
more waits for the oldest (its `to_replicas`, early), which frees its input.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.groups import Group, group_size
from tandem.parallel.data_parallel.samples import PassSamples
from tandem.parallel.layout import splits
from tandem.parallel.layout.split_grads import as_split_grad

MAX_IN_FLIGHT = 2  # reduce-scatters whose whole-unit input is alive at once
_in_flight: deque[GradientReduction] = deque()  # oldest first; backward runs on one thread


class GradientReduction:
    """One unit's gradient reduction over `group` (its shards) and `replicate` (HSDP)."""

    def __init__(self, size: int, group: Group | None, replicate: Group | None,
                 reduce_dtype: torch.dtype | None) -> None:
        self.size, self.group = size, group
        self.replicate = replicate if replicate is not None and group_size(replicate) > 1 else None
        self.replicas = group_size(self.replicate) if self.replicate is not None else 1
        self.reduce_dtype = reduce_dtype
        self.unsynced: torch.Tensor | None = None  # accumulated while gradient sync is off
        self._pending: tuple[Any, Any] | None = None  # (work, its output)
        self._input: torch.Tensor | None = None  # alive until the reduce-scatter is done
        self._scattered = True  # no reduce-scatter outstanding
        self._samples = PassSamples()  # uneven batches: each pass by its samples

    def start(self, grad: torch.Tensor, shard: torch.Tensor, sync: bool) -> bool:
        """Start reducing the unit's gradient (True), or accumulate it while `sync` is off."""
        # This pass's weight (1 on an even batch): each micro-batch of a window by its own.
        factor = self._samples.factor(self.size * self.replicas)
        if not sync:
            grad = grad.to(shard.dtype)
            if self.unsynced is None:
                self.unsynced = grad.mul(factor) if factor != 1.0 else grad.clone()
            else:
                self.unsynced.add_(grad, alpha=factor)
            return False
        if self.unsynced is not None:
            grad, self.unsynced = self.unsynced.add_(grad, alpha=factor), None
            factor = 1.0  # applied
        grad = grad.to(self.reduce_dtype or shard.dtype)
        n, s = self.size, shard.numel()
        packed = torch.empty(n, s + 2, dtype=grad.dtype, device=grad.device)
        packed[:, :s].copy_(grad.view(n, s))
        packed[:, s] = torch.isfinite(grad).all().logical_not().to(grad.dtype)
        if factor != 1.0:  # an uneven batch: this rank's gradient by its samples
            packed[:, :s].mul_(factor)
        packed[:, s + 1] = self._samples.divisor()
        work, out = None, packed[0]
        if n > 1:
            work, out, self._input = direct.reducescatter_into(
                torch.empty(s + 2, dtype=grad.dtype, device=grad.device), packed.view(-1), "sum",
                self.group)
        self._pending, self._scattered = (work, out), False
        _in_flight.append(self)
        while len(_in_flight) > MAX_IN_FLIGHT:
            _in_flight.popleft().to_replicas()
        return True

    def to_replicas(self) -> None:
        """Wait for the reduce-scatter; HSDP: start the sum of its result over the replicas.
        Once per reduction (early, when later units need the memory; else at the end)."""
        if self._scattered:
            return
        self._scattered = True
        if self in _in_flight:
            _in_flight.remove(self)
        work, out = self._pending
        self._input = None
        if work is not None:
            work.wait(runtime.state().timeout)
        work = None
        if self.replicate is not None:
            work, staged = direct.allreduce_into(out, "sum", self.replicate)
            out = staged if staged is out else (out, staged)
        self._pending = (work, out)

    def finish(self, shard: torch.Tensor, mesh: Any = None) -> None:
        """The mean goes into (or onto) `shard.grad`, in the shard's dtype and memory; with a
        `mesh` the shard is a DTensor parameter and its `.grad` a DTensor of the same layout
        (torch's norms of it reduce over the mesh themselves)."""
        param, local = shard, (shard._local_tensor if mesh is not None else shard)
        shard = local
        work, out = self._pending
        self._pending = None
        if work is not None:
            work.wait(runtime.state().timeout)
        if isinstance(out, tuple):
            out = out[0].copy_(out[1])
        out = out.to(shard.device, shard.dtype)
        s = shard.numel()
        # the summed weights: ranks x replicas on an even step, the samples on an uneven one
        shard_grad = out[:s].div_(out[s + 1:])
        shard_grad[:1].add_(torch.where(out[s] > 0, float("inf"), 0.0))
        splits.graded(param)  # an optimizer that holds no shard is refused (once)
        if mesh is not None:
            if param.grad is None:
                param.grad = _dtensor_like(param, shard_grad)
            else:
                param.grad._local_tensor.add_(shard_grad)
        elif shard.grad is None:  # torch's norms of it are the unit's global norm
            shard.grad = as_split_grad(shard_grad, splits.split_of(shard))
        else:
            shard.grad.add_(shard_grad)


def _dtensor_like(param: Any, local: torch.Tensor) -> Any:
    """`local` (same storage) as a DTensor laid out as `param`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
