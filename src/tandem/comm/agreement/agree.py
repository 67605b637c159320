"""One way for ranks to agree: compare once, cheaply; on a mismatch, name every rank's version.

    agree(description, group, explain=lambda ranks, everyone: "...")

Whatever the ranks must share before they communicate (a collective's arguments, a model's
gradient layout, the tensors of a broadcast, a pipeline's plan), each rank reduces its own
description to a few integer codes (by default one `checksum`). One all-reduce of
`[codes, -codes]` with MAX gives every rank the largest and the smallest value of each code:
where they differ, the ranks disagree. When they agree that message of a few int64 is the whole
cost. On a mismatch (the slow path) every rank gathers every rank's description and raises the
same error, a `CollectiveMismatchError` (or a subclass), whose message `explain` writes from
all of them. Every rank takes part in the same exchanges whatever it holds, so the agreement
itself cannot deadlock on a mismatch.

Every agreement message has the same size (`WIDTH` codes, padded), whatever is being agreed
on: MPI and Gloo match collectives by their order alone, so when the ranks' code paths have
diverged (one rank steps the optimizer while another calls `td.broadcast`) the two agreements
meet each other, find that they differ, and every rank raises one error that names what each
rank was doing (`DivergedError`), instead of one rank's message being read as another's data.

Hot paths agree once, at construction; the gradient reducer also sends one such message per
round, when checks are on (see `parallel/operation_check.py`); user-facing collectives agree on
every call (`checks`), unless checks are off.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
import zlib
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from tandem.comm import context
from tandem.comm.agreement import exchange
from tandem.comm.engines.backend import Group, Work, on_wire
from tandem.comm.members import group_ranks, group_size

Explain = Callable[[tuple[int, ...], list[Any]], str | BaseException]


class CollectiveMismatchError(ValueError):
    """Ranks disagree on something they must share: a collective's arguments, a layout, a plan."""


class DivergedError(CollectiveMismatchError):
    """Ranks are in different operations: their code paths diverged (a skipped step, a
    collective called on some ranks only). Nothing was sent."""


class LayoutMismatchError(CollectiveMismatchError):
    """Ranks passed different sets of tensors to an operation that needs them to match."""


@functools.lru_cache(maxsize=1024)
def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def checksum(description: str | Sequence[str] | Any) -> int:
    """A non-negative 31-bit code of a description: a string, lines of text, or any value (its repr)."""
    if isinstance(description, str):
        return _crc(description)
    if isinstance(description, (list, tuple)):
        return _crc("\n".join(map(str, description)))
    return _crc(repr(description))


WIDTH = 24  # codes per agreement message, padded: every agreement is the same collective
_PAD = -(2**40)
_NO_SAY = -(2**62)


class _Anything(tuple):
    """The type of `ANY`."""


ANY: Sequence[int] = _Anything()  # `codes=ANY`: take part in an agreement without a say in it
NO_SAY = _NO_SAY  # one code with no say: the others' highest and lowest there are theirs alone


def _fixed(codes: Sequence[int]) -> list[int]:
    """`codes` padded to `WIDTH` (a longer list keeps WIDTH - 1 codes and a checksum of the rest)."""
    codes = [int(c) for c in codes]
    if len(codes) > WIDTH:
        codes = codes[: WIDTH - 1] + [checksum(codes[WIDTH - 1 :])]
    return codes + [_PAD] * (WIDTH - len(codes))


class Posted(NamedTuple):
    """An agreement's message in flight (`post`), finished by `agree(..., posted=)`."""

    codes: Sequence[int]
    work: Work
    message: torch.Tensor
    values: list[int] | None = None  # what was sent: a result equal to it is "all agree"


class Prepared:
    """An agreement's message made once for codes that recur (`prepare`; the argument check
    keeps one per collective and shape): `tensor` holds it, and a result equal to `values` is
    the whole answer, all ranks agree.

    The message travels in `wire`, a CPU copy of `tensor` made once: a result equal to
    `values` is the message itself (the highest of equal codes is that code), so the same
    buffer is sent again next time, with no allocation and no copy per call. A wire that came
    back with other values (a mismatch), or that another call holds, is replaced by a copy.
    The wire's result is read as bytes, compared with `raw` (`values` as int64 bytes) through
    `view`, a NumPy view of the wire: 0.2 us, where `tolist()` and a list comparison of 48
    codes cost 0.7 us or more, next to a 3 us message.
    """

    __slots__ = ("codes", "tensor", "values", "wire", "view", "raw", "run", "engine")

    def __init__(self, codes: Sequence[int], tensor: torch.Tensor, values: list[int]) -> None:
        self.codes, self.tensor, self.values = codes, tensor, values
        self.wire: torch.Tensor | None = None
        self.view: np.ndarray | None = None  # the wire's memory, while `wire` holds it
        self.raw = b""  # made with the view, when the message is first sent again
        # The engine's prepared all-reduce of the wire on the world (MPI's `allreduce_plan`),
        # and the engine it was made by.
        self.run: Callable | None = None
        self.engine: Any = None


def _values(codes: Sequence[int]) -> list[int]:
    # ANY (a rank with no say, e.g. one out of data answering td.join's rounds) sends the
    # lowest value in both halves: the others' highest and lowest are then theirs alone. A
    # NO_SAY code does the same for one code (hvd.join's rank has a say in its flag only).
    if codes is ANY:
        return [_NO_SAY] * (2 * WIDTH)
    if len(codes) > WIDTH:
        fixed = _fixed(codes)
    else:  # `_fixed`, written out with C-level maps: the reducer posts one per step
        fixed = list(map(int, codes))
        fixed += [_PAD] * (WIDTH - len(fixed))
    negated = list(map(operator.neg, fixed))
    if _NO_SAY in fixed:
        negated = [_NO_SAY if c == _NO_SAY else -c for c in fixed]
    return fixed + negated


def prepare(codes: Sequence[int]) -> Prepared:
    """The message of `codes`, made once (see `Prepared`)."""
    values = _values(codes)
    return Prepared(codes, torch.tensor(values, dtype=torch.int64), values)


def post(codes: Sequence[int], group: Group | None, engine: context.Context) -> Posted:
    """Start the agreement's all-reduce now; whoever posts must finish it (`agree`) before the
    group's next operation. The reducer posts at the round's first gradient, so the message
    travels while backward computes and the first bucket rarely waits for it."""
    # Plain lists and one small tensor: on MPI a whole collective takes microseconds, so the
    # agreement's own bookkeeping must not cost more than its message.
    values = _values(codes)
    both = torch.tensor(values, dtype=torch.int64)
    backend = engine.backend
    if backend is not _takes[0] or not _takes[1]:
        if not _takes_cpu(backend):
            both = on_wire(both, backend)
    return Posted(codes, engine.backend.allreduce(both, "max", group), both, values)


_CPU = torch.device("cpu")
_takes: list = [None, False]  # the last backend asked, and whether it takes CPU tensors


def _takes_cpu(backend) -> bool:
    if _takes[0] is not backend:
        _takes[:] = [backend, backend.supports_device(_CPU)]
    return _takes[1]


def differing(codes: Sequence[int], group: Group | None, engine: context.Context,
              posted: Posted | None = None, prepared: Prepared | None = None
              ) -> dict[int, tuple[int, int]]:
    """{index: (highest, lowest)} for the codes on which the ranks differ ({} when they agree):
    one all-reduce of 2 x WIDTH int64, the same message for every agreement (`posted`: already
    on its way; `prepared`: its message, made before)."""
    n = WIDTH
    if posted is not None:
        posted.work.wait(engine.timeout)
        result = posted.message.tolist()
        if result == posted.values:  # every rank's codes equal this rank's: they agree
            return {}
    else:
        prepared = prepared or prepare(codes)
        backend = engine.backend
        both = prepared.wire
        if both is not None and backend is _takes[0] and _takes[1]:
            # This call's until it comes back unchanged (with the view and the plan made for
            # it: a call between that finds no wire makes its own, and keeps it).
            prepared.wire = None
            view, run = prepared.view, prepared.run
            # Waited for at once: the engine may finish it on the spot (Backend.allreduce_now).
            if group is None and prepared.engine is backend:
                work = run(both)
            else:
                work = backend.allreduce_now(both, "max", group)
            if work is not None:
                work.wait(engine.timeout)
            if view.tobytes() == prepared.raw:  # all agree: sent as it is next time
                if prepared.wire is None:
                    prepared.wire = both
                return {}
            result = both.tolist()
        else:
            both = prepared.tensor.clone()
            if not _takes_cpu(backend):
                both = on_wire(both, backend)
            work = backend.allreduce_now(both, "max", group)
            if work is not None:
                work.wait(engine.timeout)
            result = both.tolist()
            if result == prepared.values:  # every rank's codes equal this rank's: they agree
                if both.is_cpu and prepared.wire is None:
                    # It holds the message again: sent as it is next time, read through a view
                    # of its memory (made here once; the wire stays alive in `prepared`), by
                    # the engine's prepared call when it makes them (MPI, on the world).
                    make = getattr(backend, "allreduce_plan", None) if group is None else None
                    run = make(both, "max", getattr(backend, "watchdog", None)) if make else None
                    prepared.view, prepared.run = _view(both), run
                    prepared.engine = backend if run is not None else None
                    prepared.raw = struct.pack(f"={len(result)}q", *result)
                    prepared.wire = both
                return {}
    return {i: (result[i], -result[n + i]) for i in range(n)
            if result[i] != -result[n + i] and result[i] != _NO_SAY}


def _view(wire: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU int64 tensor's memory that does not keep the tensor alive."""
    memory = (ctypes.c_char * wire.nbytes).from_address(wire.data_ptr())
    return np.frombuffer(memory, dtype=np.int64)


def highest(posted: Posted) -> list[int]:
    """The highest value of each code over the group (NO_SAY where no rank had a say), once
    `posted`'s agreement is finished (`agree(..., posted=posted)`): what a rank with no say
    learns of the others' operation (hvd.join's rank answers it)."""
    return posted.message[:WIDTH].tolist()


def everyone(mine: Any, group: Group | None = None, engine: context.Context | None = None) -> list:
    """Every rank's `mine`, in group order (the slow path: no check, two messages)."""
    return exchange.objects(exchange.pickled(mine), group, engine or context.current())


def agree(
    mine: Any,
    group: Group | None = None,
    *,
    explain: Explain,
    codes: Sequence[int] | None = None,
    tolerated: Collection[int] = (),
    error: type[CollectiveMismatchError] = CollectiveMismatchError,
    engine: context.Context | None = None,
    posted: Posted | None = None,
    prepared: Prepared | None = None,
    differ: dict[int, tuple[int, int]] | None = None,
) -> dict[int, tuple[int, int]]:
    """Raise on every rank unless every rank of `group` holds the same `mine`.

    `mine` is this rank's description (picklable), or a function that makes it: it is only
    needed on a mismatch. `codes` are its integer codes (default: `[checksum(mine)]`). On a
    mismatch, `explain(ranks, descriptions)` gets every rank's description in group order and
    returns the message of `error` (or an exception to raise as it is). Differences in the
    codes listed in `tolerated` alone are not an error: they are returned, as
    `{index: (highest, lowest)}` (else {}). `posted`: this agreement's message, already sent
    with `post(codes, ...)` (its codes are used); `prepared`: its message, made once by
    `prepare(codes)` for codes that recur (its codes are used); `differ`: what `differing`
    already found for `codes` (the message was exchanged: only the slow path is left).
    """
    engine = engine or context.current()
    if group_size(group, engine) == 1:
        return {}
    if posted is not None or prepared is not None:
        codes = (posted or prepared).codes
    elif codes is None:
        codes = [checksum(_describe(mine))]
    if differ is None:
        differ = differing(codes, group, engine, posted, prepared)
    if not differ or set(differ) <= set(tolerated):
        return differ
    # Every rank tags its description with the kind of agreement it is in: ranks whose code
    # paths diverged are in different kinds, and get one message that names each rank's.
    kind = f"{error.__name__}:{getattr(explain, '__qualname__', '')}:{len(codes)}"
    try:
        tagged = everyone((kind, _describe(mine)), group, engine)
    except CollectiveMismatchError:
        raise
    except Exception as failure:  # noqa: BLE001 - the ranks' messages were not ours
        raise DivergedError(
            f"rank {engine.world.rank}: the ranks disagreed and then could not exchange what each "
            f"is doing: this rank is in {_describe(mine)}, and the others are in another "
            f"operation (a rank skipped or added a collective; their code paths diverged). "
            f"The exchange failed with {type(failure).__name__}: {failure}") from None
    ranks = group_ranks(group, engine)
    kinds = [t[0] if isinstance(t, tuple) and len(t) == 2 else None for t in tagged]
    if any(k != kind for k in kinds):
        said = [t[1] for t, k in zip(tagged, kinds, strict=True) if k is not None]
        raise DivergedError(explain_diverged(ranks, [_summary(t) for t in tagged], advice_of(said)))
    descriptions = [t[1] for t in tagged]
    try:
        reason = explain(ranks, descriptions)
    except Exception:  # noqa: BLE001 - the reporter itself must not fail on odd descriptions
        reason = explain_diverged(ranks, [_summary(t) for t in tagged])
    raise reason if isinstance(reason, BaseException) else error(reason)


def _describe(mine: Any) -> Any:
    return mine() if callable(mine) else mine


def _summary(tagged: Any) -> str:
    """One rank's description, as one readable line, whatever it sent."""
    text = tagged[1] if isinstance(tagged, tuple) and len(tagged) == 2 else tagged
    if isinstance(text, (list, tuple)):
        text = "; ".join(map(str, text[:3])) + (" ..." if len(text) > 3 else "")
    elif isinstance(text, dict):
        text = ", ".join(f"{k}={v!r}" for k, v in list(text.items())[:4])
    text = str(text)
    return text if len(text) <= 300 else text[:297] + "..."


SKIP_ADVICE = (
    "A rank took a different code path from the others (for example `if not "
    "torch.isfinite(loss): continue` on one rank only). Decide together: "
    "`if not td.all_finite(loss): continue` skips the step on every rank at once "
    "(docs/failures.md, 'Skipping a step on every rank').")


class Described(str):
    """A rank's description that carries its own fix, for when the ranks diverge: a call that
    every rank must make (`full_state_dict`) says so instead of the advice on skipped steps."""

    advice: str

    def __new__(cls, text: str, advice: str) -> Described:
        described = super().__new__(cls, text)
        described.advice = advice
        return described

    def __reduce__(self):
        return Described, (str(self), self.advice)


def advice_of(descriptions: Iterable[Any]) -> str:
    """The fixes that the ranks' descriptions carry (`Described`), else `SKIP_ADVICE`."""
    found = [d.advice for d in descriptions if isinstance(d, Described)]
    return "\n".join(dict.fromkeys(found)) or SKIP_ADVICE


def explain_diverged(ranks: Sequence[int], calls: Sequence[str], advice: str = SKIP_ADVICE) -> str:
    """The error when ranks are in different operations."""
    lines = "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
    return f"ranks are in different operations (nothing was sent):\n{lines}\n{advice}"


# -- tensors ----------------------------------------------------------------------------------


def describe_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per tensor: name, shape and dtype (what `agree_layout` compares)."""
    return [
        f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for name, t in named
    ]


def agree_layout(what: str, layout: list[str], group: Group | None = None, *, always: bool = False) -> None:
    """Raise `LayoutMismatchError` on every rank unless all ranks pass the same `layout`.

    Costs one all-reduce of two integers; only on a mismatch do the ranks exchange their
    layouts, to say which rank differs from the first rank of the group, and where.
    Skipped when argument checks are off (`td.init(checks=False)`) unless `always`.
    """
    if always or context.current().checks:
        agree(layout, group, explain=functools.partial(explain_layout, what), error=LayoutMismatchError)


def explain_layout(what: str, ranks: tuple[int, ...], layouts: list[list[str]],
                   advice: str = "Build the same model (and optimizer) on every rank before this "
                                 "call.") -> str:
    """Which rank holds which tensor where the ranks' layouts first differ, then `advice`."""
    reference = layouts[0]
    lines = [f"{what}: the ranks hold different tensors (compared with rank {ranks[0]}):"]
    for rank, theirs in zip(ranks[1:], layouts[1:], strict=True):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            lines.append(f"  rank {rank} has {len(theirs)} tensors, rank {ranks[0]} has {len(reference)}")
        for i, (mine, other) in enumerate(zip(reference, theirs, strict=False)):
            if mine != other:
                lines.append(f"  tensor #{i}: rank {ranks[0]} has {mine}; rank {rank} has {other}")
                break
    lines.append(advice)
    return "\n".join(lines)
