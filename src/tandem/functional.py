"""Collectives that autograd can differentiate through.

`td.allreduce` and friends move data; their results carry no gradient back to the inputs. These
do: each is a `torch.autograd.Function` whose backward is the collective that the chain rule
asks for, so a model can communicate in the middle of its forward (tensor parallelism, branches
on different ranks, a loss over the gathered batch) and still train.

The convention is the one of `torch.distributed.nn.functional`: the quantity differentiated is
the *sum over ranks* of every rank's loss. Under it

    all_reduce   (sum)  backward: all_reduce (sum) of the gradient
    all_reduce   (mean) backward: all_reduce (mean) of the gradient
    all_gather          backward: each rank's slice of the gradient, summed over ranks
    reduce_scatter      backward: all_gather of the gradient (divided by n for "mean")
    broadcast           backward: gradients summed onto the root, zero elsewhere
    all_to_all          backward: the inverse all_to_all
    send / recv         backward: the gradient travels back the way the tensor came

Front ends that define another convention (Horovod's averages some of these) scale on top.
Roots, sources and destinations are global ranks, as everywhere in tandem; every rank of the
group must call each function, in the same order, and run the backward too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.comm import collectives, context
from tandem.comm.groups import Group, group_rank, group_size

_LINEAR_OPS = ("sum", "mean")


def _linear_op(op: str, name: str) -> str:
    if op not in _LINEAR_OPS:
        raise ValueError(
            f"{name} is differentiable for op='sum' or op='mean', got op={op!r}; for min/max "
            f"use td.{name.replace('_', '')} (not differentiable) or gather and reduce locally"
        )
    return op


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """The sum (or mean) over ranks, on every rank; differentiable."""
    return _AllReduce.apply(tensor, _linear_op(op, "all_reduce"), group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, group):
        ctx.op, ctx.group = op, group
        return collectives.allreduce(tensor.contiguous(), op, group=group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.allreduce(grad.contiguous(), ctx.op, group=ctx.group), None, None


def all_gather(tensor: torch.Tensor, dim: int = 0, group: Group | None = None) -> torch.Tensor:
    """Every rank's tensor concatenated along `dim` in rank order; sizes along `dim` may differ."""
    return _AllGather.apply(tensor, dim, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        moved = tensor.movedim(dim, 0).contiguous()
        # Each rank's length along `dim` places its slice of the gradient in backward.
        lengths = collectives.allgather(torch.tensor([moved.shape[0]], dtype=torch.int64), group=group)
        ctx.dim, ctx.group = dim, group
        ctx.lengths = [int(n) for n in lengths]
        return collectives.allgather(moved, group=group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        lengths = ctx.lengths
        if len(set(lengths)) == 1:
            mine = collectives.reducescatter(moved, "sum", group=ctx.group)
        else:
            summed = collectives.allreduce(moved, "sum", group=ctx.group)
            start = sum(lengths[: group_rank(ctx.group)])
            mine = summed[start : start + lengths[group_rank(ctx.group)]]
        return mine.movedim(0, ctx.dim), None, None


def reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", dim: int = 0, group: Group | None = None
) -> torch.Tensor:
    """Reduce over ranks, then give group rank i the i-th of n equal chunks along `dim`."""
    return _ReduceScatter.apply(tensor, _linear_op(op, "reduce_scatter"), dim, group)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, dim, group):
        ctx.op, ctx.dim, ctx.group = op, dim, group
        moved = tensor.movedim(dim, 0).contiguous()
        return collectives.reducescatter(moved, op, group=group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        gathered = collectives.allgather(grad.movedim(ctx.dim, 0).contiguous(), group=ctx.group)
        if ctx.op == "mean":
            gathered = gathered / group_size(ctx.group)
        return gathered.movedim(0, ctx.dim), None, None, None


def broadcast(tensor: torch.Tensor, root: int = 0, group: Group | None = None) -> torch.Tensor:
    """`root`'s tensor on every rank; the root's input receives every rank's gradient."""
    return _Broadcast.apply(tensor, root, group)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, group):
        ctx.root, ctx.group = root, group
        return collectives.broadcast(tensor.contiguous(), root, group=group)

    @staticmethod
    def backward(ctx, grad):
        total = collectives.reduce(grad.contiguous(), ctx.root, "sum", group=ctx.group)
        if context.current().world.rank != ctx.root:
            total = torch.zeros_like(grad)
        return total, None, None


def all_to_all(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, group: Group | None = None
) -> torch.Tensor:
    """Send `splits[j]` rows (dim 0) to group rank j, equal parts when None; differentiable."""
    return _AllToAll.apply(tensor, splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, group):
        n = group_size(group)
        output = collectives.alltoall(tensor.contiguous(), splits, group=group)
        sent = [int(k) for k in splits] if splits is not None else [tensor.shape[0] // n] * n
        # What arrived from each rank is what goes back to it in backward.
        arrived = collectives.alltoall(torch.tensor(sent, dtype=torch.int64), [1] * n, group=group)
        ctx.received, ctx.group = [int(k) for k in arrived], group
        return output

    @staticmethod
    def backward(ctx, grad):
        return collectives.alltoall(grad.contiguous(), ctx.received, group=ctx.group), None, None


def send(tensor: torch.Tensor, dst: int, tag: int = 0, group: Group | None = None) -> torch.Tensor:
    """Send `tensor` to global rank `dst`; returns a zero scalar that keeps the send in the graph.

    Backpropagating through the returned scalar (add it to the loss, or call `.backward()` on
    it) receives `dst`'s gradient for `tensor` and continues backward from there.
    """
    return _Send.apply(tensor, dst, tag, group)


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dst, tag, group):
        ctx.dst, ctx.tag, ctx.group = dst, tag, group
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        collectives.send(tensor.contiguous(), dst, tag, group=group)
        return torch.zeros((), dtype=tensor.dtype, device=tensor.device)

    @staticmethod
    def backward(ctx, _token_grad):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        collectives.recv(grad, ctx.dst, ctx.tag, group=ctx.group)
        return grad, None, None, None


def recv(
    shape: Sequence[int],
    src: int,
    dtype: torch.dtype = torch.float32,
    tag: int = 0,
    device: torch.device | str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """A tensor received from global rank `src` that requires grad; its gradient goes back to
    `src` (whose `send` token's backward is waiting for it)."""
    anchor = torch.empty(0, device=device, requires_grad=True)
    return _Recv.apply(anchor, tuple(shape), src, dtype, tag, group)


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, src, dtype, tag, group):
        ctx.src, ctx.tag, ctx.group = src, tag, group
        received = torch.empty(shape, dtype=dtype, device=anchor.device)
        return collectives.recv(received, src, tag, group=group)

    @staticmethod
    def backward(ctx, grad):
        collectives.send(grad.contiguous(), ctx.src, ctx.tag, group=ctx.group)
        return None, None, None, None, None, None
