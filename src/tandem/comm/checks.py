"""Argument agreement: ranks that call a collective differently get one clear error.

Before a user-facing collective communicates, each rank encodes what it is about to do
(collective, op, dtype, shape, root, device) as a fixed-size vector of int64. One all-reduce of
`[v, -v]` with MAX gives every rank both the maximum and the minimum of each field: where they
differ, the ranks disagree. Only then (the slow path) do the ranks exchange readable
descriptions, so that the error shows what each rank passed. The check is the same collective
on every rank whatever the arguments, so it cannot itself deadlock on a mismatch.

In debug mode two more fields carry the collective's fingerprint (`comm.fingerprints`):
its sequence number on the group and a hash of the user's call site, so a rank that skipped a
collective is caught by the same single all-reduce. The same collective reached from different
lines is only a warning (once per pair of lines): code that branches on the rank does that on
purpose (`if rank == 0: ...; td.barrier() else: td.barrier()`). `barrier`
and `allgather_object`, which have no arguments to check, go through `agree_on_call()`: they
are checked too, because MPI matches collectives by their order alone, so a rank that skipped
an all-reduce and entered a barrier would otherwise complete its barrier against the other
ranks' next message and fail later on garbage. The two fingerprint fields are always present
(-1 when debug is off), so the vector has the same size on every rank.
"""

from __future__ import annotations

import functools
import sys
import zlib

import torch

from tandem.comm import context, fingerprints

_SHAPE_SLOTS = 12
_HEADER = ("collective", "op", "dtype", "ndim", "root", "device", "seq", "site")
_WIDTH = len(_HEADER) + _SHAPE_SLOTS + 1  # + a hash of any dims beyond the slots
_IGNORED = -1
_NO_ARGUMENTS = ("barrier", "allgather_object")  # only the call itself is compared


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not agree."""


@functools.lru_cache(maxsize=1024)
def _code(text: str | None) -> int:
    return _IGNORED if text is None else zlib.crc32(text.encode()) & 0x7FFFFFFF


def describe(
    collective: str,
    tensor: torch.Tensor,
    op: str | None = None,
    root: int | None = None,
    ignore_dim0: bool = False,
) -> str:
    if collective in _NO_ARGUMENTS:
        return f"{collective}()"
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


def _encode(collective, tensor, op, root, ignore_dim0, fingerprint=None) -> list[int]:
    shape = list(tensor.shape)
    if ignore_dim0 and shape:
        shape[0] = _IGNORED
    slots = shape[:_SHAPE_SLOTS] + [_IGNORED - 1] * (_SHAPE_SLOTS - min(len(shape), _SHAPE_SLOTS))
    extra = _code(",".join(map(str, shape[_SHAPE_SLOTS:]))) if len(shape) > _SHAPE_SLOTS else 0
    values = [
        _code(collective), _code(op), _code(str(tensor.dtype)), tensor.dim(),
        _IGNORED if root is None else root, _code(tensor.device.type),
        _IGNORED if fingerprint is None else fingerprint.seq,
        _IGNORED if fingerprint is None else fingerprint.site_code, *slots, extra,
    ]
    return values


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
    state = context.current()
    if not (state.checks or state.debug):
        return
    from tandem.comm.groups import group_size

    if group_size(group) == 1:
        return
    fingerprint = None
    if state.debug and not fingerprints.suspended():
        stream = "world" if group is None else tuple(group.ranks)
        fingerprint = fingerprints.next_fingerprint(collective, stream)
    mine = _encode(collective, tensor, op, root, ignore_dim0, fingerprint)
    # Plain lists and one small tensor: on MPI a whole collective takes microseconds, so the
    # check's own bookkeeping must not cost more than its message.
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    backend = state.backend
    target = both if backend.supports_device(both.device) else both.to(state.world.device)
    backend.allreduce(target, "max", group).wait(state.timeout)
    result = target.tolist()
    high, low = result[:_WIDTH], [-v for v in result[_WIDTH:]]
    if high == low:
        return
    differ = [i for i in range(_WIDTH) if high[i] != low[i]]
    mine_text = describe(collective, tensor, op, root, ignore_dim0)
    if fingerprint is not None:
        mine_text = f"#{fingerprint.seq} {mine_text} at {fingerprint.site}"
        if differ == [_SITE]:
            # The same collective from different lines: legitimate when the code branches on
            # the rank (`if rank == 0: barrier() else: barrier()`), so a warning, once per
            # pair of lines (every rank sees the same pair, so all decide alike).
            _warn_sites(mine_text, group, (high[_SITE], low[_SITE]))
            return
    _raise_mismatch(mine_text, group, debug=fingerprint is not None)


_SITE = _HEADER.index("site")
_warned_sites: set[tuple[int, int]] = set()


def _warn_sites(mine: str, group, sites: tuple[int, int]) -> None:
    if sites in _warned_sites:
        return
    _warned_sites.add(sites)
    from tandem.comm.collectives import allgather_object
    from tandem.comm.groups import group_ranks

    with fingerprints.suspend():
        calls = allgather_object(mine, group=group)
    ranks = group_ranks(group)
    if context.current().world.rank == ranks[0]:
        lines = "\n".join(f"  rank {r}: {call}" for r, call in zip(ranks, calls, strict=True))
        print(f"tandem debug: ranks reached one collective from different lines:\n{lines}\n"
              "Fine if the code branches on the rank; otherwise a rank skipped a collective "
              "(this is said once per pair of lines).", file=sys.stderr, flush=True)


_NOTHING = torch.empty(0, dtype=torch.uint8)


def agree_on_call(collective: str, group=None, tensor: torch.Tensor | None = None) -> None:
    """Check that every rank is in this same collective (`barrier`, `allgather_object`)."""
    if not fingerprints.suspended():
        agree(collective, _NOTHING if tensor is None else tensor, group,
              ignore_dim0=tensor is not None)


def _raise_mismatch(mine: str, group, debug: bool = False) -> None:
    from tandem.comm.collectives import allgather_object
    from tandem.comm.groups import group_ranks

    # Every rank saw the same disagreement, so every rank is here: a safe second exchange
    # (without fingerprints: the ranks may be here from different lines).
    with fingerprints.suspend():
        calls = allgather_object(mine, group=group)
    lines = "\n".join(f"  rank {r}: {call}" for r, call in zip(group_ranks(group), calls, strict=True))
    advice = "Make every rank pass the same shape, dtype, op and root."
    if debug:
        advice = ("Make every rank call the same collectives in the same order, from the same "
                  "lines, with the same shape, dtype, op and root (debug mode compares the "
                  "sequence numbers #n and the call sites too).")
    raise CollectiveMismatchError(
        "ranks called a collective with different arguments (nothing was sent):\n"
        f"{lines}\n{advice}"
    )
