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

Inside the forward of a tensor-parallel model (`td.parallelize`, `td.tensor.Branches`, a model with
tensor-parallel layers), whose forward and backward each open with one agreement over the group,
these go straight to the engine (`comm/collectives/direct.py`): no check, nothing read on the host but the
sizes an uneven `all_gather` or `all_to_all` must learn. Elsewhere each call, forward and
backward, is checked as `td.allreduce` is (one small agreement, then the data; `checks=False`
turns it off). Sizes are exchanged once per call, never twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from tandem.comm import context
from tandem.comm.agreement import checks, exchange
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.groups import Group, group_rank, group_ranks, group_size

_LINEAR_OPS = ("sum", "mean")


def _linear_op(op: str, name: str) -> str:
    if op not in _LINEAR_OPS:
        raise ValueError(
            f"{name} is differentiable for op='sum' or op='mean', got op={op!r}; for min/max "
            f"use td.{name.replace('_', '')} (not differentiable) or gather and reduce locally"
        )
    return op


Check = Callable[..., None]  # (collective, tensor, group, *, op=, root=, ignore_dim0=)
_local = threading.local()


@contextmanager
def checked_by(check: Check) -> Iterator[None]:
    """Check every call made inside (its forward and, later, its backward) with `check`, the
    per-call agreement of a front end that has its own (`tandem.horovod`'s negotiation, which
    joined ranks answer), instead of tandem's argument check."""
    before, _local.check = getattr(_local, "check", None), check
    try:
        yield
    finally:
        _local.check = before


def _checker(group: Group | None, root: int | None = None) -> Check | None:
    """How this call is checked: None when a model's agreement covers it (see module doc)."""
    if group is not None and group.rank < 0:
        raise ValueError(f"rank {context.current().world.rank} is not a member of {group!r}; "
                         "only members may call it")
    if root is not None and root not in group_ranks(group):
        raise ValueError(f"root={root} is not a rank of the group {list(group_ranks(group))}")
    check = getattr(_local, "check", None)
    if check is not None:
        return check
    return None if direct.frame(group) is not None else checks.agree


def _agree(check: Check | None, collective: str, tensor: torch.Tensor, group: Group | None,
           **kw) -> None:
    if check is not None:
        check(collective, tensor, group, **kw)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """The sum (or mean) over ranks, on every rank; differentiable."""
    return _AllReduce.apply(tensor, _linear_op(op, "all_reduce"), group, _checker(group))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, group, check):
        ctx.op, ctx.group, ctx.check = op, group, check
        _agree(check, "allreduce", tensor, group, op=op)
        return direct.allreduce(tensor, op, group)

    @staticmethod
    def backward(ctx, grad):
        _agree(ctx.check, "allreduce", grad, ctx.group, op=ctx.op)
        return direct.allreduce(grad, ctx.op, ctx.group), None, None, None


def all_gather(tensor: torch.Tensor, dim: int = 0, group: Group | None = None) -> torch.Tensor:
    """Every rank's tensor concatenated along `dim` in rank order; sizes along `dim` may differ."""
    return _AllGather.apply(tensor, dim, group, _checker(group))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, check):
        moved = tensor.movedim(dim, 0).contiguous()
        _agree(check, "allgather", moved, group, ignore_dim0=True)
        # Each rank's length along `dim`: the output's size, and where this rank's slice of
        # the gradient lies in backward (one exchange).
        lengths = exchange.lengths(moved.shape[0], group, context.current())
        ctx.dim, ctx.group, ctx.check, ctx.lengths = dim, group, check, lengths
        return direct.allgather_uneven(moved, lengths, group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        lengths = ctx.lengths
        if len(set(lengths)) == 1:
            _agree(ctx.check, "reducescatter", moved, ctx.group, op="sum")
            mine = direct.reducescatter(moved, "sum", ctx.group)
        else:
            _agree(ctx.check, "allreduce", moved, ctx.group, op="sum")
            summed = direct.allreduce(moved, "sum", ctx.group)
            start = sum(lengths[: group_rank(ctx.group)])
            mine = summed[start : start + lengths[group_rank(ctx.group)]]
        return mine.movedim(0, ctx.dim), None, None, None


def reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", dim: int = 0, group: Group | None = None
) -> torch.Tensor:
    """Reduce over ranks, then give group rank i the i-th of n equal chunks along `dim`."""
    n = group_size(group)
    if tensor.dim() == 0 or tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter needs dim {dim} divisible by the group size {n}; got "
                         f"shape {tuple(tensor.shape)}. Pad the tensor or use all_reduce.")
    return _ReduceScatter.apply(tensor, _linear_op(op, "reduce_scatter"), dim, group,
                                _checker(group))


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, dim, group, check):
        ctx.op, ctx.dim, ctx.group, ctx.check = op, dim, group, check
        moved = tensor.movedim(dim, 0).contiguous()
        _agree(check, "reducescatter", moved, group, op=op)
        return direct.reducescatter(moved, op, group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        _agree(ctx.check, "allgather", moved, ctx.group)
        gathered = direct.allgather(moved, ctx.group)
        if ctx.op == "mean":
            gathered = gathered / group_size(ctx.group)
        return gathered.movedim(0, ctx.dim), None, None, None, None


def broadcast(tensor: torch.Tensor, root: int = 0, group: Group | None = None) -> torch.Tensor:
    """`root`'s tensor on every rank; the root's input receives every rank's gradient."""
    return _Broadcast.apply(tensor, root, group, _checker(group, root))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, group, check):
        ctx.root, ctx.group, ctx.check = root, group, check
        _agree(check, "broadcast", tensor, group, root=root)
        return direct.broadcast(tensor, root, group)

    @staticmethod
    def backward(ctx, grad):
        _agree(ctx.check, "reduce", grad, ctx.group, op="sum", root=ctx.root)
        total = direct.reduce(grad, ctx.root, "sum", ctx.group)
        if context.current().world.rank != ctx.root:
            total = torch.zeros_like(grad)
        return total, None, None, None


def all_to_all(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, group: Group | None = None
) -> torch.Tensor:
    """Send `splits[j]` rows (dim 0) to group rank j, equal parts when None; differentiable."""
    n = group_size(group)
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % n:
            raise ValueError(f"all_to_all without splits needs dim 0 divisible by the group size "
                             f"{n}; got shape {tuple(tensor.shape)}. Pass splits=[rows for each rank].")
        splits = [rows // n] * n
    splits = [int(k) for k in splits]
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all splits {splits} must be {n} non-negative counts summing "
                         f"to dim 0 ({rows})")
    return _AllToAll.apply(tensor, splits, group, _checker(group))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, sent, group, check):
        _agree(check, "alltoall", tensor, group, ignore_dim0=True)
        # What arrives from each rank (ranks may hold different numbers of rows, even in equal
        # parts) is what goes back to it in backward: one exchange of counts.
        counts = torch.tensor(sent, dtype=torch.int64)
        received = direct.alltoall(counts, [1] * len(sent), [1] * len(sent), group).tolist()
        ctx.sent, ctx.received, ctx.group, ctx.check = sent, received, group, check
        return direct.alltoall(tensor.contiguous(), received, sent, group)

    @staticmethod
    def backward(ctx, grad):
        _agree(ctx.check, "alltoall", grad, ctx.group, ignore_dim0=True)
        back = direct.alltoall(grad.contiguous(), ctx.sent, ctx.received, ctx.group)
        return back, None, None, None


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
