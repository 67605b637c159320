"""Argument agreement: ranks that call a collective differently get one clear error.

Before a user-facing collective communicates, each rank encodes what it is about to do
(collective, op, dtype, shape, root, device) as a fixed-size vector of int64. One all-reduce of
`[v, -v]` with MAX gives every rank both the maximum and the minimum of each field: where they
differ, the ranks disagree. Only then (the slow path) do the ranks exchange readable
descriptions, so that the error shows what each rank passed. The check is the same collective
on every rank whatever the arguments, so it cannot itself deadlock on a mismatch.
"""

from __future__ import annotations

import zlib

import torch

from tandem import runtime

_SHAPE_SLOTS = 12
_HEADER = ("collective", "op", "dtype", "ndim", "root", "device")
_WIDTH = len(_HEADER) + _SHAPE_SLOTS + 1  # + a hash of any dims beyond the slots
_IGNORED = -1


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not agree."""


def _code(text: str | None) -> int:
    return _IGNORED if text is None else zlib.crc32(text.encode()) & 0x7FFFFFFF


def describe(
    collective: str,
    tensor: torch.Tensor,
    op: str | None = None,
    root: int | None = None,
    ignore_dim0: bool = False,
) -> str:
    shape = list(tensor.shape)
    if ignore_dim0 and shape:
        shape[0] = "*"
    parts = [f"shape=({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})",
             f"dtype={str(tensor.dtype).replace('torch.', '')}"]
    if op is not None:
        parts.append(f"op={op!r}")
    if root is not None:
        parts.append(f"root={root}")
    return f"{collective}({', '.join(parts)})"


def _encode(collective, tensor, op, root, ignore_dim0) -> torch.Tensor:
    shape = list(tensor.shape)
    if ignore_dim0 and shape:
        shape[0] = _IGNORED
    slots = shape[:_SHAPE_SLOTS] + [_IGNORED - 1] * (_SHAPE_SLOTS - min(len(shape), _SHAPE_SLOTS))
    extra = _code(",".join(map(str, shape[_SHAPE_SLOTS:]))) if len(shape) > _SHAPE_SLOTS else 0
    values = [
        _code(collective), _code(op), _code(str(tensor.dtype)), tensor.dim(),
        _IGNORED if root is None else root, _code(tensor.device.type), *slots, extra,
    ]
    return torch.tensor(values, dtype=torch.int64)


def agree(
    collective: str,
    tensor: torch.Tensor,
    group=None,
    *,
    op: str | None = None,
    root: int | None = None,
    ignore_dim0: bool = False,
) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks pass the same arguments."""
    state = runtime.state()
    if not state.checks:
        return
    from tandem.comm.groups import group_size

    if group_size(group) == 1:
        return
    mine = _encode(collective, tensor, op, root, ignore_dim0)
    both = torch.cat([mine, -mine])
    backend = state.backend
    target = both if backend.supports_device(both.device) else both.to(state.world.device)
    backend.allreduce(target, "max", group).wait(state.timeout)
    high, neg_low = target.cpu().split(_WIDTH)
    if torch.equal(high, -neg_low):
        return
    _raise_mismatch(describe(collective, tensor, op, root, ignore_dim0), group)


def _raise_mismatch(mine: str, group) -> None:
    from tandem.comm.collectives import allgather_object
    from tandem.comm.groups import group_ranks

    # Every rank saw the same disagreement, so every rank is here: a safe second exchange.
    calls = allgather_object(mine, group=group)
    lines = "\n".join(f"  rank {r}: {call}" for r, call in zip(group_ranks(group), calls, strict=True))
    raise CollectiveMismatchError(
        "ranks called a collective with different arguments (nothing was sent):\n"
        f"{lines}\nMake every rank pass the same shape, dtype, op and root."
    )
