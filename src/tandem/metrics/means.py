"""Means of named values over the ranks: the one reduction of `td.metrics.Average` and
`td.metrics.MetricLogger`.

    means = reduce_means("Average.compute", {"loss": 12.3}, count=40, group=None, may_be_empty=True)

The ranks first agree on the names, then sum. A sum alone would be silently wrong when they
disagree: rank 0's `loss` added to rank 1's `acc` in the same slot gives a number that is
neither. So each rank sends the project's one agreement message (`comm.agreement.agree`: a few
integer codes, the same fixed size as every argument check) with a code for the call, the
number of names and a checksum of the sorted names, and then the sums and the count, as one
float64 all-reduce. That is the two messages an all-reduce with its argument check costs: the
agreement takes the check's place (the sum itself goes unchecked), and it runs even with
`checks=False`, because a rank without samples needs it (below) and these calls are not per
step. Agreements of one size on every rank mean a rank that is in another operation is found
too (`DivergedError`, naming what each rank was doing), never a hang.

When the names differ, every rank raises `MetricMismatchError`, naming the call, each rank's
names and the names not on every rank. The exception is `Average`, where a rank may have seen
no samples at all (no `update()`, so no names): that difference is tolerated, every rank then
sees every rank's names (two more messages, only in that case), the empty rank sends zeros and
the means are over the samples that exist. A name whose total count is 0 (every rank called
`update(0, ...)`) has mean NaN; when no rank has any name the result is `{}`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tandem import runtime
from tandem.comm import context
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement.agree import CollectiveMismatchError
from tandem.comm.collectives import direct
from tandem.comm.groups import Group, group_ranks, group_size

_KIND = agreement.checksum("tandem.metrics.means: names, then sums")
_NAME_CODES = (2, 3)  # positions of the number of names and their checksum in the codes


class MetricMismatchError(CollectiveMismatchError):
    """Ranks passed different metric names to `MetricLogger.log` or `Average.compute`."""


@dataclass(frozen=True)
class Call:
    """One rank's side of the agreement: what it called with which names (sent on a mismatch)."""

    what: str
    names: tuple[str, ...]
    may_be_empty: bool  # a rank without names has seen no samples (Average)

    def __str__(self) -> str:  # also how a DivergedError shows this rank's operation
        if self.names:
            return f"{self.what}({', '.join(self.names)})"
        return f"{self.what} with no names" + (
            " (no samples: it takes the others' names)" if self.may_be_empty else "")


def reduce_means(what: str, sums: Mapping[str, float], count: float, group: Group | None, *,
                 may_be_empty: bool) -> dict[str, float]:
    """{name: sum over ranks of sums[name] / sum over ranks of count}, in sorted name order.

    Collective over `group` once tandem is initialised. `what` names the call in errors
    (`"MetricLogger.log"`); `may_be_empty`: a rank without names has seen no samples and takes
    the others' names (Average), instead of being a mismatch (MetricLogger).
    """
    names = sorted(sums)
    totals = [float(sums[name]) for name in names] + [float(count)]
    if runtime.is_initialized() and group_size(group) > 1:
        if group is not None and group.rank < 0:
            raise ValueError(f"{what}: this rank is not a member of {group!r}; only its members "
                             "may call it")
        engine = context.current()
        agreed = _agree_on_names(what, names, group, engine, may_be_empty)
        if not agreed:
            return {}
        mine = dict(zip(names, totals, strict=False))
        totals = _sum([mine.get(name, 0.0) for name in agreed] + [totals[-1]], group)
        names = agreed
    total = totals[-1]
    return {name: (totals[i] / total if total else math.nan) for i, name in enumerate(names)}


def _agree_on_names(what: str, names: list[str], group: Group | None, engine: context.Context,
                    may_be_empty: bool) -> list[str]:
    """The names every rank reduces: this rank's, or the others' when it has none (Average)."""
    mine = Call(what, tuple(names), may_be_empty)
    codes = [_KIND, agreement.checksum(what), len(names), agreement.checksum(repr(names))]
    differ = agreement.agree(mine, group, codes=codes, engine=engine, error=MetricMismatchError,
                             tolerated=_NAME_CODES if may_be_empty else (), explain=explain)
    if not differ:
        return names
    # Only the names differ and some rank may be without samples: every rank saw the same
    # difference and is here, so every rank takes part in this exchange.
    everyone = agreement.everyone(mine, group, engine)
    named = {call.names for call in everyone if call.names}
    if len(named) != 1:
        raise MetricMismatchError(explain(group_ranks(group), everyone))
    return list(named.pop())


def _sum(values: list[float], group: Group | None) -> list[float]:
    """One float64 all-reduce of `values`, without a second argument check (agreed above)."""
    return direct.allreduce(torch.tensor(values, dtype=torch.float64), "sum", group,
                            inplace=True).tolist()


def explain(ranks: Sequence[int], calls: Sequence[Call]) -> str:
    """The error when ranks reduce different names, or are in different metric calls."""
    lines = "\n".join(f"  rank {rank}: {call}" for rank, call in zip(ranks, calls, strict=True))
    whats = sorted({call.what for call in calls})
    if len(whats) > 1:
        return (f"ranks are in different metric reductions ({', '.join(whats)}; nothing was "
                f"averaged):\n{lines}\nEvery rank must make the same call at the same point.")
    what, empty_ok = whats[0], calls[0].may_be_empty
    having: dict[str, list[int]] = {}
    for rank, call in zip(ranks, calls, strict=True):
        for name in call.names:
            having.setdefault(name, []).append(rank)
    counted = [r for r, call in zip(ranks, calls, strict=True) if call.names or not empty_ok]
    differing = [f"{name!r} (only on rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held))})"
                 for name, held in sorted(having.items()) if len(held) < len(counted)]
    advice = ("Call update() with the same names on every rank; a rank without samples may skip "
              "update() (or call update(0, ...)) and then counts for nothing."
              if empty_ok else
              "Pass the same names on every rank at each call; to average a value that only some "
              "ranks have, over those ranks, use td.metrics.Average (a rank without samples skips update()).")
    return (f"{what}: the ranks passed different metric names (nothing was averaged):\n{lines}\n"
            f"Names not on every rank: {', '.join(differing)}.\n{advice}")

