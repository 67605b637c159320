"""The argument check: ranks that call a collective differently get one clear error.

Before a user-facing collective communicates, each rank encodes what it is about to do
(collective, op, dtype, shape, root, device) as a fixed-size vector of int64 codes, and the
ranks compare them with the agreement primitive (`agreement.agree`): one all-reduce gives
every rank the maximum and the minimum of each field, and where they differ the ranks
disagree. Only then (the slow path) do the ranks exchange readable descriptions, so that the
error shows what each rank passed. The check is the same collective on every rank whatever the
arguments, so it cannot itself deadlock on a mismatch.

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

import sys

import torch

from tandem.comm import agreement, context, fingerprints
from tandem.comm.members import group_ranks, group_size

_SHAPE_SLOTS = 12
_HEADER = ("collective", "op", "dtype", "ndim", "root", "device", "seq", "site")
_SITE = _HEADER.index("site")
_IGNORED = -1
_NO_ARGUMENTS = ("barrier", "allgather_object")  # only the call itself is compared


def _code(text: str | None) -> int:
    return _IGNORED if text is None else agreement.checksum(text)


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
    engine: context.Context | None = None,
) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks pass the same arguments.

    `engine`: the engine to check over, when not td.init's (a torch.distributed group's)."""
    engine = engine or context.current()
    if not (engine.checks or engine.debug) or group_size(group, engine) == 1:
        return
    if not engine.debug:  # the same codes whenever this collective meets this shape again
        prepared = _prepared(collective, tensor, op, root, ignore_dim0)
        differ = agreement.differing(prepared.codes, group, engine, prepared=prepared)
        if differ:  # the slow path: every rank saw the same difference, and names every call
            agreement.agree(lambda: describe(collective, tensor, op, root, ignore_dim0), group,
                            codes=prepared.codes, engine=engine, explain=_explain, differ=differ)
        return
    stream = "world" if group is None else tuple(group.ranks)
    fingerprint = fingerprints.next_fingerprint(collective, stream)

    def mine() -> str:  # the readable call, only made on a mismatch
        text = describe(collective, tensor, op, root, ignore_dim0)
        return f"#{fingerprint.seq} {text} at {fingerprint.site}"
    # The same collective from different lines is legitimate when the code branches on the
    # rank (`if rank == 0: barrier() else: barrier()`): a warning, not an error.
    differ = agreement.agree(
        mine, group, codes=_encode(collective, tensor, op, root, ignore_dim0, fingerprint),
        tolerated=(_SITE,), engine=engine, explain=_explain_debug)
    if differ:
        _warn_sites(mine(), group, engine, differ[_SITE])


_PREPARED: dict[tuple, agreement.Prepared] = {}
_MOST_PREPARED = 4096  # kinds of call kept (a job makes a few dozen); past it, start again


def _prepared(collective, tensor, op, root, ignore_dim0) -> agreement.Prepared:
    """The message of this call, made once per collective, shape, dtype, op and root: a small
    message takes MPI a few microseconds, so encoding it again each time would cost more."""
    key = (collective, tensor.shape, tensor.dtype, op, root, ignore_dim0, tensor.device.type)
    found = _PREPARED.get(key)
    if found is None:
        if len(_PREPARED) >= _MOST_PREPARED:
            _PREPARED.clear()
        found = _PREPARED[key] = agreement.prepare(
            _encode(collective, tensor, op, root, ignore_dim0))
    return found


def _lines(ranks, calls) -> str:
    return "\n".join(f"  rank {r}: {call}" for r, call in zip(ranks, calls, strict=True))


def _explain(ranks, calls, advice: str = "Make every rank pass the same shape, dtype, op and root.") -> str:
    return ("ranks called a collective with different arguments (nothing was sent):\n"
            f"{_lines(ranks, calls)}\n{advice}")


def _explain_debug(ranks, calls) -> str:
    return _explain(ranks, calls, "Make every rank call the same collectives in the same order, "
                    "from the same lines, with the same shape, dtype, op and root (debug mode "
                    "compares the sequence numbers #n and the call sites too).")


_warned_sites: set[tuple[int, int]] = set()


def _warn_sites(mine: str, group, engine: context.Context, sites: tuple[int, int]) -> None:
    """Once per pair of lines (every rank sees the same pair, so all decide alike)."""
    if sites in _warned_sites:
        return
    _warned_sites.add(sites)
    calls = agreement.everyone(mine, group, engine)
    ranks = group_ranks(group, engine)
    if engine.world.rank == ranks[0]:
        print(f"tandem debug: ranks reached one collective from different lines:\n"
              f"{_lines(ranks, calls)}\nFine if the code branches on the rank; otherwise a rank "
              "skipped a collective (this is said once per pair of lines).",
              file=sys.stderr, flush=True)


_NOTHING = torch.empty(0, dtype=torch.uint8)


def agree_on_call(collective: str, group=None, tensor: torch.Tensor | None = None,
                  engine: context.Context | None = None) -> None:
    """Check that every rank is in this same collective (`barrier`, `allgather_object`)."""
    agree(collective, _NOTHING if tensor is None else tensor, group,
          ignore_dim0=tensor is not None, engine=engine)
