"""The argument check: ranks that call a collective differently get one clear error.

Before a user-facing collective communicates, each rank encodes what it is about to do
(collective, op, dtype, shape, root, device) as a fixed-size vector of int64 codes, and the
ranks compare them with the agreement primitive (`agreement.agree`): one all-reduce gives
every rank the maximum and the minimum of each field, and where they differ the ranks
disagree. Only then (the slow path) do the ranks exchange readable descriptions, so that the
error shows what each rank passed. The check is the same collective on every rank whatever the
arguments, so it cannot itself deadlock on a mismatch.

Two more fields say which call this is. The user's call site (a code of `file:line`, the first
frame outside tandem and torch: `comm.agreement.fingerprints`) is in every mode, so a rank that skipped
one of two same-shaped collectives in a row is found at the first call the ranks pair wrongly,
before anything is sent (rank 0 at `a = td.allreduce(x)`, rank 1 already at
`b = td.allreduce(y)`): without it both would sum x with y. It rides in the message that the
check sends anyway, and costs a walk of a few frames per call. When the call sites alone
differ, the ranks exchange them (the slow path, once per pair of lines and group) and judge
the two lines from the file's syntax tree (`comm.agreement.call_sites`):

* a skip (the later line follows the earlier one in the same block, made by every rank that
  gets there): a `DivergedError` on every rank, in every mode, naming each rank's call and line;
* branches of one if/else (`if rank == 0: td.broadcast(x) else: td.broadcast(y)`): correct
  code, accepted in every mode (debug mode says so once per pair of lines);
* anything else: accepted by default, because a correct program may look like it (a branch
  through two `if`s, two functions or an early return), and refused in debug mode
  (`td.init(debug=True)` / `TANDEM_DEBUG=1`), which compares call sites strictly.

Debug mode also carries the collective's sequence number on its group (`comm.agreement.fingerprints`),
so a rank that skipped a collective earlier is caught even when the lines agree. `barrier`
and `allgather_object`, which have no arguments to check, go through `agree_on_call()`: they
are checked too, because MPI matches collectives by their order alone, so a rank that skipped
an all-reduce and entered a barrier would otherwise complete its barrier against the other
ranks' next message and fail later on garbage. The sequence field is always present (-1 when
debug is off), so the vector has the same size on every rank.
"""

from __future__ import annotations

import sys

import torch

from tandem.comm import context
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import call_sites, fingerprints
from tandem.comm.members import group_ranks

_SHAPE_SLOTS = 12
_HEADER = ("collective", "op", "dtype", "ndim", "root", "device", "seq", "site")
_SITE = _HEADER.index("site")
_DIM0 = len(_HEADER)  # the first shape slot: tolerated with `ignore_dim0`, and reported
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


def _encode(collective, tensor, op, root, ignore_dim0, site: int, seq: int = _IGNORED) -> list[int]:
    # With `ignore_dim0` the first dim is sent all the same, as a difference the check
    # tolerates: equal first dims (the usual all-gather) then need no exchange of lengths.
    shape = list(tensor.shape)
    slots = shape[:_SHAPE_SLOTS] + [_IGNORED - 1] * (_SHAPE_SLOTS - min(len(shape), _SHAPE_SLOTS))
    extra = _code(",".join(map(str, shape[_SHAPE_SLOTS:]))) if len(shape) > _SHAPE_SLOTS else 0
    values = [
        _code(collective), _code(op), _code(str(tensor.dtype)), tensor.dim(),
        _IGNORED if root is None else root, _code(tensor.device.type), seq, site, *slots, extra,
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
) -> bool | None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks pass the same arguments,
    or `DivergedError` when a rank skipped a collective (the module docstring says when).

    `engine`: the engine to check over, when not td.init's (a torch.distributed group's).
    Returns, with `ignore_dim0`, whether every rank's first dim equals this rank's (True,
    False), or None when nothing was compared (checks off, or a group of one)."""
    engine = engine or context.current()
    if not (engine.checks or engine.debug) \
            or (engine.world.size if group is None else group.size) == 1:
        return None
    site = fingerprints.site_key()  # the user's line: the caller's caller, outward
    if not engine.debug:  # the same codes whenever this line makes this call again
        prepared = _PREPARED.get((collective, tensor.shape, tensor.dtype, op, root, ignore_dim0,
                                  tensor.is_cpu or tensor.device.type, site))
        if prepared is None:
            prepared = _prepared(collective, tensor, op, root, ignore_dim0, site)
        differ = agreement.differing(prepared.codes, group, engine, prepared=prepared)
        if not differ:
            return True
        return _differed(collective, tensor, group, op, root, ignore_dim0, engine, site,
                         prepared, differ)
    stream = "world" if group is None else tuple(group.ranks)
    fingerprint = fingerprints.next_fingerprint(collective, stream, site)

    def numbered() -> str:  # the readable call, only made on a mismatch
        return f"#{fingerprint.seq} {describe(collective, tensor, op, root, ignore_dim0)}"

    def mine() -> str:
        return f"{numbered()} at {fingerprint.site}"
    codes = _encode(collective, tensor, op, root, ignore_dim0, fingerprint.site_code,
                    fingerprint.seq)
    differ = agreement.agree(mine, group, codes=codes, engine=engine, explain=_explain_debug,
                             tolerated=(_SITE, _DIM0) if ignore_dim0 else (_SITE,))
    if _SITE in differ:
        _judge_sites(numbered, site, group, engine, differ[_SITE], strict=True)
    return _DIM0 not in differ


def _differed(collective, tensor, group, op, root, ignore_dim0, engine, site, prepared,
              differ: dict) -> bool:
    """`agree` once the ranks' codes differed somewhere (`differ`): tolerated first dims, a
    judged pair of lines, or the error on every rank."""
    same_dim0 = not (ignore_dim0 and differ.pop(_DIM0, None))
    if not differ:
        return same_dim0

    def call() -> str:
        return describe(collective, tensor, op, root, ignore_dim0)
    if set(differ) == {_SITE}:  # the same call from other lines: a skip or a branch?
        _judge_sites(call, site, group, engine, differ[_SITE], strict=False)
        return same_dim0
    # the slow path: every rank saw the same difference, and names every call
    agreement.agree(call, group, codes=prepared.codes, engine=engine, explain=_explain,
                    differ=differ)
    return same_dim0


def agree_again(collective: str, tensor: torch.Tensor, engine: context.Context, seen: list,
                *, op: str | None = None, root: int | None = None) -> None:
    """`agree` on the world for a call its caller repeats on one tensor's memory (a small
    `td.allreduce`'s or `td.broadcast`'s plan), with checks on: the message that the last call
    made at the same line with the same shape is kept in `seen` ([line, shape, message], the
    caller's), so the call costs the line's walk, a comparison of shapes and the message."""
    if engine.debug or engine.world.size == 1:
        agree(collective, tensor, None, op=op, root=root, engine=engine)
        return
    site = fingerprints.site_key()  # the user's line, outward past tandem's frames
    shape = tensor.shape
    if site is seen[0] and shape == seen[1]:
        prepared = seen[2]
    else:
        prepared = _prepared(collective, tensor, op, root, False, site)
        seen[:] = site, shape, prepared
    differ = agreement.differing(prepared.codes, None, engine, prepared=prepared)
    if differ:
        _differed(collective, tensor, None, op, root, False, engine, site, prepared, differ)


_PREPARED: dict[tuple, agreement.Prepared] = {}
_MOST_PREPARED = 4096  # kinds of call kept (a job makes a few dozen); past it, start again


def _prepared(collective, tensor, op, root, ignore_dim0, site) -> agreement.Prepared:
    """The message of this call, made once per collective, shape, dtype, op, root and line: a
    small message takes MPI a few microseconds, so encoding it again each time would cost more."""
    key = (collective, tensor.shape, tensor.dtype, op, root, ignore_dim0,
           tensor.is_cpu or tensor.device.type, site)  # (as `agree` looks it up)
    found = _PREPARED.get(key)
    if found is None:
        if len(_PREPARED) >= _MOST_PREPARED:
            _PREPARED.clear()
        found = _PREPARED[key] = agreement.prepare(
            _encode(collective, tensor, op, root, ignore_dim0, fingerprints.site_code(site)))
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


_warned_sites: set[tuple] = set()  # pairs of lines debug mode said were branches


def _judge_sites(call, site: tuple[str, int], group, engine: context.Context,
                 pair: tuple[int, int], strict: bool) -> None:
    """The ranks agree on every argument but their lines: raise on every rank if the lines are
    a skip (or, `strict`, unless they are branches of one if/else); else remember the pair, so
    that the next calls from these lines cost nothing more.

    Every rank of the group is here with the same `pair` (the highest and lowest line code),
    so every rank takes part in the same exchange and, reading the same file, decides alike.
    """
    key = (None if group is None else tuple(group.ranks), pair)
    if key in fingerprints.judged:
        return
    said = agreement.everyone((call(), fingerprints.Site.of(site)), group, engine)
    ranks = group_ranks(group, engine)
    where = [s for _, s in said]
    verdict, lines = _verdict(where, site[0])
    if verdict == call_sites.SKIP or (strict and verdict != call_sites.BRANCHES):
        calls = [f"{text} at {s.text}" for text, s in said]
        raise agreement.DivergedError(
            _explain_skip(ranks, calls, where, lines) if verdict == call_sites.SKIP
            else _explain_strict(ranks, calls))
    fingerprints.judged.add(key)
    if strict and pair not in _warned_sites:
        _warned_sites.add(pair)
        if engine.world.rank == ranks[0]:
            print("tandem debug: ranks reached one collective from the branches of one if/else:\n"
                  f"{_lines(ranks, [f'{t} at {s.text}' for t, s in said])}\n(said once per "
                  "pair of lines)", file=sys.stderr, flush=True)


def _verdict(where: list[fingerprints.Site], path: str) -> tuple[str, tuple[int, int] | None]:
    """What the ranks' lines are to each other, when they all read one file; else UNKNOWN."""
    if len({(s.name, s.source) for s in where}) != 1 or where[0].source is None:
        return call_sites.UNKNOWN, None
    source = fingerprints.source_of(where[0], path)
    if source is None:
        return call_sites.UNKNOWN, None
    return call_sites.verdict(source, [s.line for s in where])


def _explain_skip(ranks, calls, where: list[fingerprints.Site], lines: tuple[int, int]) -> str:
    earlier, later = (f"{where[0].name}:{line}" for line in lines)
    past = ", ".join(str(r) for r, s in zip(ranks, where, strict=True) if s.line == lines[1])
    return (f"ranks reached one collective from different lines, and {later} comes after "
            f"{earlier} in the same block: rank(s) {past}, at {later}, went past the "
            f"collective at {earlier} without calling it (a skipped collective; nothing was "
            f"sent, which would have combined two different tensors):\n{_lines(ranks, calls)}\n"
            f"Make every rank call the collective at {earlier}, or none: a condition on the "
            "rank around a collective (`if rank == 0:`) skips it on the others. To decide "
            "together, reduce the condition first (e.g. `td.all_finite`).")


def _explain_strict(ranks, calls) -> str:
    return ("ranks reached one collective from different lines that are not the branches of "
            "one if/else, so debug mode cannot tell a deliberate branch from a skipped "
            f"collective (nothing was sent):\n{_lines(ranks, calls)}\nCall it from one line on "
            "every rank (choose the tensor first: `t = x if rank == 0 else y`), or from the "
            "branches of one if/else. Without debug mode, only a proven skip is refused.")


_NOTHING = torch.empty(0, dtype=torch.uint8)


def agree_on_call(collective: str, group=None, tensor: torch.Tensor | None = None,
                  engine: context.Context | None = None) -> bool | None:
    """Check that every rank is in this same collective (`barrier`, `allgather_object`); with
    `tensor`, say whether every rank's first dim equals this rank's (as `agree` does)."""
    return agree(collective, _NOTHING if tensor is None else tensor, group,
          ignore_dim0=tensor is not None, engine=engine)
