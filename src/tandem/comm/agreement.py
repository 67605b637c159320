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

Hot paths (the gradient reducer, the pipeline) agree once, at construction, and pay nothing
per step; user-facing collectives agree on every call (`checks`), unless checks are off.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch

from tandem.comm import context, exchange
from tandem.comm.backend import Group
from tandem.comm.groups import group_ranks, group_size

Explain = Callable[[tuple[int, ...], list[Any]], str | BaseException]


class CollectiveMismatchError(ValueError):
    """Ranks disagree on something they must share: a collective's arguments, a layout, a plan."""


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


def differing(codes: Sequence[int], group: Group | None, engine: context.Context
              ) -> dict[int, tuple[int, int]]:
    """{index: (highest, lowest)} for the codes on which the ranks differ ({} when they agree):
    one all-reduce of 2 x len(codes) int64."""
    codes = list(codes)
    # Plain lists and one small tensor: on MPI a whole collective takes microseconds, so the
    # agreement's own bookkeeping must not cost more than its message.
    both = context.on_wire(torch.tensor(codes + [-c for c in codes], dtype=torch.int64), engine)
    engine.backend.allreduce(both, "max", group).wait(engine.timeout)
    result = both.tolist()
    n = len(codes)
    return {i: (result[i], -result[n + i]) for i in range(n) if result[i] != -result[n + i]}


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
) -> dict[int, tuple[int, int]]:
    """Raise on every rank unless every rank of `group` holds the same `mine`.

    `mine` is this rank's description (picklable), or a function that makes it: it is only
    needed on a mismatch. `codes` are its integer codes (default: `[checksum(mine)]`). On a
    mismatch, `explain(ranks, descriptions)` gets every rank's description in group order and
    returns the message of `error` (or an exception to raise as it is). Differences in the
    codes listed in `tolerated` alone are not an error: they are returned, as
    `{index: (highest, lowest)}` (else {}).
    """
    engine = engine or context.current()
    if group_size(group) == 1:
        return {}
    if codes is None:
        codes = [checksum(mine() if callable(mine) else mine)]
    differ = differing(codes, group, engine)
    if not differ or set(differ) <= set(tolerated):
        return differ
    descriptions = everyone(mine() if callable(mine) else mine, group, engine)
    reason = explain(group_ranks(group), descriptions)
    raise reason if isinstance(reason, BaseException) else error(reason)


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
        agree(layout, group, explain=functools.partial(_explain_layout, what), error=LayoutMismatchError)


def _explain_layout(what: str, ranks: tuple[int, ...], layouts: list[list[str]]) -> str:
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
    lines.append("Build the same model (and optimizer) on every rank before this call.")
    return "\n".join(lines)
