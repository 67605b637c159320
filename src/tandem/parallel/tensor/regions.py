"""The four conjugate communication pairs of tensor parallelism (Megatron-LM's "regions").

Inside a tensor-parallel group every rank holds the same activations outside the split layers
and computes the same loss: the loss is *replicated*, not summed over ranks. Under that
convention the pairs are

    copy_to      forward: identity             backward: all-reduce (sum) of the gradient
    reduce_from  forward: all-reduce (sum)     backward: identity
    gather_from  forward: all-gather (concat)  backward: keep this rank's slice
    scatter_to   forward: keep this rank's slice  backward: all-gather

so a column-parallel layer followed by a row-parallel one communicates once forward
(`reduce_from`) and once backward (`copy_to`). They differ from `td.functional`, whose
convention is a loss summed over ranks (data parallelism, branches that feed one rank each).

Their collectives go straight to the engine (`comm/collectives/direct.py`): the forward they run in opens
with one agreement over the group, and so does its backward (`guard`); shards are equal, so no
size is exchanged. A tensor that enters the split region several times in one forward (the
input of separate q, k and v projections) enters once: its gradient is summed locally and
all-reduced once, as a fused projection's would be.

Under torch.compile the regions are torch custom operators (`region_ops`): a compiled graph
holds them, with no graph break, and they run the same engine calls when the graph runs.
Eagerly they are the autograd functions below, as before (nothing else is asked per call
than whether dynamo is tracing).
"""

from __future__ import annotations

import torch

from tandem.comm.collectives import direct
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_size
from tandem.parallel.tensor import guard, region_ops
from tandem.parallel.tensor.region_ops import gather_over as _gather
from tandem.parallel.tensor.region_ops import split_of as _split
from tandem.parallel.tensor.region_ops import sum_over as _sum


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, checked):
        ctx.group, ctx.checked = group, checked
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.group, ctx.checked), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, checked):
        return _sum(tensor, group, checked)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, checked):
        ctx.dim, ctx.group = dim, group
        return _gather(tensor, dim, group, checked)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, checked):
        ctx.dim, ctx.group, ctx.checked = dim, group, checked
        return _split(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.checked), None, None, None


def copy_to(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Enter a split region: identity forward, gradients summed over the group backward."""
    if torch.compiler.is_compiling():
        return region_ops.copy_to(tensor, group)
    return _copy_to(tensor, group)


def reduce_from(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Leave a split region by summing the partial results: all-reduce forward, identity back."""
    if torch.compiler.is_compiling():
        return region_ops.reduce_from(tensor, group)
    if group_size(group) == 1:
        return tensor
    return _ReduceFrom.apply(tensor, group, guard.ensure(group))


def gather_from(tensor: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Leave a split region by concatenating the shards along `dim`."""
    if torch.compiler.is_compiling():
        return region_ops.gather_from(tensor, group, dim % tensor.dim())
    if group_size(group) == 1:
        return tensor
    return _GatherFrom.apply(tensor, dim % tensor.dim(), group, guard.ensure(group))


def scatter_to(tensor: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Enter a split region by keeping this rank's equal slice along `dim`."""
    if torch.compiler.is_compiling():
        return region_ops.scatter_to(tensor, group, dim % tensor.dim())
    if group_size(group) == 1:
        return tensor
    return _ScatterTo.apply(tensor, dim % tensor.dim(), group, guard.ensure(group))


def _copy_to(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group_size(group) == 1:
        return tensor
    checked = guard.ensure(group)
    frame = None if checked else direct.frame(group)
    if frame is None or not (tensor.requires_grad and torch.is_grad_enabled()):
        return _CopyTo.apply(tensor, group, checked)
    # Entered already in this forward (and not modified since): the same entry, so that the
    # gradients of its readers add up locally and travel once.
    known = frame.entered.get(id(tensor))
    if known is not None and known[0] is tensor and known[1] == tensor._version:
        return known[2]
    entered = _CopyTo.apply(tensor, group, checked)
    frame.entered[id(tensor)] = (tensor, tensor._version, entered)
    return entered
