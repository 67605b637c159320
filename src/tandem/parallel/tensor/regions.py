"""Megatron's conjugate regions: the four autograd functions tensor parallelism is built from.

They differ from `tandem.functional` in what is differentiated. `tandem.functional` follows
`torch.distributed.nn`: the loss is the *sum over ranks* of every rank's loss. Inside a
tensor-parallel group every rank computes the *same* loss (the activations outside the parallel
layers are replicated), and the gradient wanted is the one of that single loss. Hence the pairs

    copy_to_group       forward: identity            backward: all-reduce (sum)
    reduce_from_group   forward: all-reduce (sum)    backward: identity
    gather_from_group   forward: all-gather last dim backward: keep this rank's slice
    scatter_to_group    forward: keep this rank's slice  backward: all-gather last dim

A column-parallel Linear opens a region with `copy_to_group`, the row-parallel Linear after it
closes it with `reduce_from_group`: an MLP communicates once forward and once backward.
"""

from __future__ import annotations

import torch

from tandem.comm import collectives
from tandem.comm.groups import Group, group_rank, group_size


def _allreduce(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group_size(group) == 1:
        return tensor
    return collectives.allreduce(tensor.contiguous(), "sum", group=group)


def _gather_last(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return tensor
    gathered = collectives.allgather(tensor.movedim(-1, 0).contiguous(), group=group)
    return gathered.movedim(0, -1).contiguous()


def _slice_last(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return tensor
    return tensor.chunk(n, dim=-1)[group_rank(group)].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return _allreduce(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _gather_last(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice_last(grad, ctx.group), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _slice_last(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_group(tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Identity forward; the gradient is summed over the group in backward."""
    return _Copy.apply(tensor, group)


def reduce_from_group(tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Sum over the group forward; the gradient passes through unchanged."""
    return _Reduce.apply(tensor, group)


def gather_from_group(tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Concatenate the ranks' equal slices along the last dim; backward keeps this rank's slice."""
    return _Gather.apply(tensor, group)


def scatter_to_group(tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return _Scatter.apply(tensor, group)
