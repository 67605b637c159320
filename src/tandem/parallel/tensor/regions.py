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
"""

from __future__ import annotations

import torch

from tandem.comm import collectives
from tandem.comm.backend import Group
from tandem.comm.groups import group_rank, group_size


def _split(tensor: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    size = tensor.shape[dim] // group_size(group)
    return tensor.narrow(dim, group_rank(group) * size, size).contiguous()


def _gather(tensor: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    moved = tensor.movedim(dim, 0).contiguous()
    return collectives.allgather(moved, group=group).movedim(0, dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return collectives.allreduce(grad.contiguous(), "sum", group=ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return collectives.allreduce(tensor.contiguous(), "sum", group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Enter a split region: identity forward, gradients summed over the group backward."""
    return _CopyTo.apply(tensor, group) if group_size(group) > 1 else tensor


def reduce_from(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Leave a split region by summing the partial results: all-reduce forward, identity back."""
    return _ReduceFrom.apply(tensor, group) if group_size(group) > 1 else tensor


def gather_from(tensor: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Leave a split region by concatenating the shards along `dim`."""
    return _GatherFrom.apply(tensor, dim % tensor.dim(), group) if group_size(group) > 1 else tensor


def scatter_to(tensor: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Enter a split region by keeping this rank's equal slice along `dim`."""
    return _ScatterTo.apply(tensor, dim % tensor.dim(), group) if group_size(group) > 1 else tensor
