"""The regions' collectives as torch custom operators, so that a compiled graph can hold them.

`torch.compile` cannot trace tandem's engine (Python calls into Gloo or MPI, asynchronous
handles, a watchdog), and a function it may not trace breaks the graph: four breaks for a
column-parallel layer followed by a row-parallel one. Registered as custom operators
(`torch.library.custom_op`), the collectives are opaque kernels instead: dynamo puts a call
in the graph, inductor calls it at run time, and the operator runs tandem's engine eagerly,
exactly as the eager regions do (`sum_over`, `gather_over` below: `comm/collectives/direct.py`, or the
checked user-facing collective). What the graph needs of them is given here:

- a fake implementation (`register_fake`): the output's shape and dtype without running
  (all-gather: `size` times longer along `dim`; a slice: `size` times shorter);
- an autograd formula (`register_autograd`) per region, the four conjugate pairs of
  `regions`: copy_to's backward is `tp_sum`, reduce_from's is the identity, gather_from's is
  `tp_split` and scatter_to's is `tp_gather`.

Arguments are tensors and ints only, so a group travels as its ranks (`()` for the whole
world) and is found again at run time among the groups that split layers were built on
(`remember`, called by `layers.mark_sliced`).

Whether a collective is checked alone is decided at run time, as the eager regions decide
it: `tp_checked` runs `guard.ensure` when the region is reached, inside the graph, and gives
the answer as a 0-dim CPU bool tensor. Its value feeds the forward's collective, and autograd
keeps it for the backward's (copy_to's and scatter_to's communicate only backward): a
backward is checked alone exactly when its forward was, as `ctx.checked` does eagerly. An
answer fixed while tracing would instead be baked into a graph that can also run where
nothing covers it. The flag is an input of the collective, so no pass can move the collective
before the check; it also keeps `tp_checked` from being folded away as a constant.

Only traced code comes here (`regions` asks `torch.compiler.is_compiling()`): the eager path
keeps its speed and its entry de-duplication (one gradient all-reduce for a tensor that enters
the split region several times in one forward), which needs `id()` and `_version` of a tensor
and so cannot be traced. Compiled, such a tensor's gradient is all-reduced once per entry:
partial sums added after the all-reduces, the same number as before. copy_to's forward copies
its input (a custom operator may not return its input), one activation-sized copy per region.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.comm import context
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size
from tandem.parallel.tensor import guard

# -- the eager collectives (also what the operators run) -------------------------------------


def split_of(tensor: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """This rank's equal slice of `tensor` along `dim`."""
    size = tensor.shape[dim] // group_size(group)
    return tensor.narrow(dim, group_rank(group) * size, size).contiguous()


def gather_over(tensor: torch.Tensor, dim: int, group: Group | None, checked: bool) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`; `checked`: with an argument check."""
    moved = tensor.movedim(dim, 0).contiguous()
    if checked:  # no agreement covers it yet (see `guard`): checked alone
        return collectives.allgather(moved, group=group).movedim(0, dim)
    return direct.allgather(moved, group).movedim(0, dim)


def sum_over(tensor: torch.Tensor, group: Group | None, checked: bool) -> torch.Tensor:
    """The sum of every rank's `tensor`, as a new tensor."""
    if checked:
        return collectives.allreduce(tensor.contiguous(), "sum", inplace=False, group=group)
    return direct.allreduce(tensor, "sum", group)


# -- groups as operator arguments -------------------------------------------------------------

_groups: dict[tuple[int, ...], Group] = {}


def remember(group: Group | None) -> None:
    """Make `group` findable by its ranks inside a compiled graph (the first one of its ranks:
    every rank builds its layers in the same order, so every rank keeps the same one)."""
    if group is not None:
        _groups.setdefault(tuple(group.ranks), group)


def ranks_of(group: Group | None) -> list[int]:
    """What an operator is given for `group` (traced: read off the group, a constant)."""
    return [] if group is None else list(group.ranks)


def _group(ranks: Sequence[int]) -> Group | None:
    if not ranks:
        return None
    found = _groups.get(tuple(ranks))
    if found is None:
        raise RuntimeError(
            f"a compiled tensor-parallel region communicates over the ranks {list(ranks)}, a "
            "group no tensor-parallel layer was built on: build the layers that use it "
            "(td.parallelize, ColumnParallelLinear, ...) before compiling, or pass that group "
            "to one of them")
    return found


def _size(ranks: Sequence[int]) -> int:
    return len(ranks) or context.current().world.size


# -- the operators ----------------------------------------------------------------------------


@torch.library.custom_op("tandem::tp_checked", mutates_args=())
def tp_checked(like: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """Whether the region reached now must check its collectives alone (`guard.ensure`)."""
    return torch.tensor(guard.ensure(_group(ranks)))


@tp_checked.register_fake
def _(like, ranks):
    return torch.empty((), dtype=torch.bool)


@torch.library.custom_op("tandem::tp_copy", mutates_args=())
def tp_copy(tensor: torch.Tensor, checked: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """copy_to's forward: the identity (a copy: an operator returns no input)."""
    return tensor.clone()


@tp_copy.register_fake
def _(tensor, checked, ranks):
    return torch.empty_like(tensor)


@torch.library.custom_op("tandem::tp_sum", mutates_args=())
def tp_sum(tensor: torch.Tensor, checked: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """The sum over the group (reduce_from's forward, copy_to's backward)."""
    return sum_over(tensor, _group(ranks), bool(checked))


@tp_sum.register_fake
def _(tensor, checked, ranks):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.custom_op("tandem::tp_gather", mutates_args=())
def tp_gather(tensor: torch.Tensor, checked: torch.Tensor, dim: int, ranks: list[int]) -> torch.Tensor:
    """Every rank's shard concatenated along `dim` (gather_from's forward, scatter_to's backward)."""
    return gather_over(tensor, dim, _group(ranks), bool(checked)).contiguous()


@tp_gather.register_fake
def _(tensor, checked, dim, ranks):
    shape = list(tensor.shape)
    shape[dim] *= _size(ranks)
    return tensor.new_empty(shape)


@torch.library.custom_op("tandem::tp_split", mutates_args=())
def tp_split(tensor: torch.Tensor, checked: torch.Tensor, dim: int, ranks: list[int]) -> torch.Tensor:
    """This rank's slice along `dim` (scatter_to's forward, gather_from's backward)."""
    part = split_of(tensor, dim, _group(ranks))
    # An operator's output may not alias its input: a slice along the first dim is a view.
    shared = part.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    return part.clone() if shared else part


@tp_split.register_fake
def _(tensor, checked, dim, ranks):
    shape = list(tensor.shape)
    shape[dim] //= _size(ranks)
    return tensor.new_empty(shape)


# -- the conjugate pairs: what each forward's backward is --------------------------------------


def _keep(ctx, inputs, output) -> None:
    """The forward's flag (its backward is checked alone when it was), the dim and the ranks."""
    ctx.save_for_backward(inputs[1])
    ctx.rest = inputs[2:]


def _copy_backward(ctx, grad):
    return tp_sum(grad, *ctx.saved_tensors, *ctx.rest), None, None


def _sum_backward(ctx, grad):
    return grad, None, None


def _gather_backward(ctx, grad):
    return tp_split(grad, *ctx.saved_tensors, *ctx.rest), None, None, None


def _split_backward(ctx, grad):
    return tp_gather(grad, *ctx.saved_tensors, *ctx.rest), None, None, None


tp_copy.register_autograd(_copy_backward, setup_context=_keep)
tp_sum.register_autograd(_sum_backward, setup_context=_keep)
tp_gather.register_autograd(_gather_backward, setup_context=_keep)
tp_split.register_autograd(_split_backward, setup_context=_keep)


# -- the regions, as traced (`regions` calls these while compiling) -------------------------
# A group of one rank is read off the group (a constant to dynamo); the whole world of one
# rank would need the engine's state in a guard, so its operators run, and sum one tensor.


def _alone(group: Group | None) -> bool:
    return group is not None and len(group.ranks) == 1


def copy_to(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    if _alone(group):
        return tensor
    ranks = ranks_of(group)
    return tp_copy(tensor, tp_checked(tensor, ranks), ranks)


def reduce_from(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    if _alone(group):
        return tensor
    ranks = ranks_of(group)
    return tp_sum(tensor, tp_checked(tensor, ranks), ranks)


def gather_from(tensor: torch.Tensor, group: Group | None, dim: int) -> torch.Tensor:
    if _alone(group):
        return tensor
    ranks = ranks_of(group)
    return tp_gather(tensor, tp_checked(tensor, ranks), dim, ranks)


def scatter_to(tensor: torch.Tensor, group: Group | None, dim: int) -> torch.Tensor:
    if _alone(group):
        return tensor
    ranks = ranks_of(group)
    return tp_split(tensor, tp_checked(tensor, ranks), dim, ranks)
