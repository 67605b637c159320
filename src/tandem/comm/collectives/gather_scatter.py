"""`td.gather` and `td.scatter`: the rooted pair of `allgather` and `broadcast`.

Like `broadcast`, every rank passes a tensor of the same shape and dtype (the root's values are
the ones that matter for `scatter`; everyone's for `gather`), so the argument check compares
them as it does for every collective. Both run on the engine's native gather and scatter (MPI's
`Igather`/`Iscatter`, torch's `gather`/`scatter`), through the watchdog.
"""

from __future__ import annotations

import torch

from tandem.comm import context
from tandem.comm.agreement import checks
from tandem.comm.collectives.user import (
    Array,
    Staging,
    check_member,
    check_rank,
    complete,
    one_rank,
    returned,
    to_torch,
)
from tandem.comm.engines.backend import Group
from tandem.comm.members import group_size


def gather(tensor: Array, root: int = 0, *, dst: int | None = None, async_op: bool = False,
           group: Group | None = None):
    """Every rank's `tensor`, concatenated along dim 0 in rank order, on `root`; None elsewhere.

    Args:
        tensor: this rank's part; the same shape and dtype on every rank.
        root: the global rank that receives them (torch's name `dst=` is accepted).
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        On `root`, a tensor of `size` x the rows of `tensor`; None on the other ranks (or a
        `Handle` with `async_op=True`).

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes or roots (each rank's named).
        ValueError: `root` is not a rank of `group`, `root=` and `dst=` name different ranks, or
            this rank is not a member of `group`.
    """
    root = one_rank("root", root, "dst", dst)
    check_member(group)
    check_rank("root", root, group)
    data, as_numpy = to_torch(tensor)
    if data.dim() == 0:
        data = data.reshape(1)
    checks.agree("gather", data, group, root=root)
    source = Staging(data.contiguous())
    mine = context.current().world.rank == root
    n = group_size(group)
    output = Staging(torch.empty((n * data.shape[0], *data.shape[1:]), dtype=data.dtype,
                                  device=data.device)) if mine else None
    work = context.current().backend.gather(output.buffer if mine else None, source.buffer,
                                            root, group)
    return complete(work, lambda: returned(output.copy_back(), as_numpy) if mine else None,
                     async_op)


def scatter(tensor: Array, root: int = 0, *, src: int | None = None, async_op: bool = False,
            group: Group | None = None):
    """The i-th of `size` equal parts (along dim 0) of `root`'s `tensor`, on rank i of the group.

    Args:
        tensor: on `root`, what is split; elsewhere a tensor of the same shape and dtype (its
            values are not read), as for `broadcast`.
        root: the global rank whose tensor is split (torch's name `src=` is accepted).
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        This rank's part: `tensor.shape[0] // size` rows (or a `Handle` with `async_op=True`).

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes or roots (each rank's named).
        ValueError: dim 0 is not divisible by the group size (pad it, or use broadcast), `root`
            is not a rank of `group`, or this rank is not a member of `group`.
    """
    root = one_rank("root", root, "src", src)
    check_member(group)
    check_rank("root", root, group)
    data, as_numpy = to_torch(tensor)
    n = group_size(group)
    if data.dim() == 0 or data.shape[0] % n:
        raise ValueError(f"scatter needs dim 0 divisible by the group size {n}; got shape "
                         f"{tuple(data.shape)}. Pad the tensor, or use broadcast")
    checks.agree("scatter", data, group, root=root)
    mine = context.current().world.rank == root
    source = Staging(data.contiguous()) if mine else None
    output = Staging(torch.empty((data.shape[0] // n, *data.shape[1:]), dtype=data.dtype,
                                  device=data.device))
    work = context.current().backend.scatter(output.buffer, source.buffer if mine else None,
                                             root, group)
    return complete(work, lambda: returned(output.copy_back(), as_numpy), async_op)
