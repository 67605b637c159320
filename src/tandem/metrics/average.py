"""Rank-0 progress bars and metrics averaged over every rank's samples
(`td.metrics.progress`, `td.metrics.Average`).

    from tandem.metrics import Average, progress

    metrics = Average()
    for x, y in progress(loader, desc=f"epoch {epoch}"):     # a bar on rank 0 only
        ...
        metrics.update(len(y), loss=loss.item(), accuracy=(out.argmax(1) == y).float().mean().item())
    summary = metrics.compute()                              # collective: every rank calls it
    if td.rank() == 0:
        print(f"epoch {epoch}: loss {summary['loss']:.4f} accuracy {summary['accuracy']:.4f}")

Averages are weighted by sample counts, so ranks with different numbers of samples (an
uneven last batch) still give the mean over all samples, and a rank that saw none (it never
called `update()`, or called `update(0, ...)`) counts for nothing. `compute()` is two small
messages (`means`: the ranks agree on the names, then sum): ranks that updated different
names get a `MetricMismatchError` that names each rank's names, on every rank, instead of a
number that mixes them. A name no sample reached (every rank's count 0) averages to NaN; with
no names on any rank, `compute()` returns {}.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

import torch
from tqdm import tqdm

from tandem import runtime
from tandem.comm.groups import Group, group_rank
from tandem.job import settings
from tandem.metrics.means import reduce_means

T = TypeVar("T")

# Without a terminal (a log file, a pipe, `tandem run` into a file), a bar is written as
# separate lines (tqdm's carriage returns become newlines), at most every 10 s, and not at all
# for loops that finish sooner. `tandem run` on a terminal passes rank 0's redraws through.
_PIPE_INTERVAL_S = 10.0


class _Lines:
    """A text stream for tqdm that turns each redraw into one plain line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():  # tqdm clears a bar by writing spaces: drop those
                self._stream.write(part.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress(iterable: Iterable[T], group: Group | None = None, *, disable: bool | None = False,
             **tqdm_kwargs: Any) -> Iterator[T]:
    """`iterable` with a tqdm bar on the first rank (of `group`) and none on the others.

    `disable` is tqdm's, on top of that: True draws no bar on any rank; None (tqdm's "only on
    a terminal") draws rank 0's bar only when the output reaches a terminal, through
    `tandem run` or directly. Other keyword arguments go to `tqdm`.

    Args:
        iterable: what to iterate over (a DataLoader, a range).
        group: the ranks whose first draws the bar (None: the world's rank 0).
        disable: True draws no bar on any rank; None draws one only on a terminal.
        **tqdm_kwargs: passed to `tqdm` (`total=`, `desc=`, `file=`, ...).

    Yields:
        The items of `iterable`, unchanged, on every rank.

    Raises:
        Nothing: keyword arguments tqdm does not take raise tqdm's own error.
    """
    first = not runtime.is_initialized() or group_rank(group) == 0
    stream = tqdm_kwargs.pop("file", None) or sys.stderr
    # Under `tandem run` our stderr is the launcher's pipe; it says when that ends on a terminal.
    relayed = stream in (sys.stderr, sys.stdout) and settings.current().terminal
    terminal = relayed or getattr(stream, "isatty", lambda: False)()
    if disable is None:  # decided here: tqdm would look at the launcher's pipe, or at _Lines
        disable = not terminal
    if not terminal:
        stream = _Lines(stream)
        tqdm_kwargs.setdefault("mininterval", _PIPE_INTERVAL_S)
        tqdm_kwargs.setdefault("delay", _PIPE_INTERVAL_S)
        tqdm_kwargs.setdefault("ascii", True)
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return iter(tqdm(iterable, file=stream, disable=bool(disable) or not first, **tqdm_kwargs))


class Average:
    """Sample-weighted running means of named values, reduced over the ranks on `compute()`.

    Args:
        group: the ranks `compute()` reduces over (None: the world).
    """

    def __init__(self, group: Group | None = None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, float] = {}
        self._count = 0

    def update(self, n: int, **values: float) -> None:
        """Add `n` samples whose mean of each named value is given (e.g. loss=0.3)."""
        if n < 0:
            raise ValueError(f"n must be the number of samples (>= 0), got {n}")
        if self._sums and set(values) != set(self._sums):
            raise ValueError(
                f"update() got values {sorted(values)}, earlier calls gave {sorted(self._sums)}; "
                f"pass the same names every time"
            )
        for name, value in values.items():
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
            self._sums[name] = self._sums.get(name, 0.0) + value * n
        self._count += n

    @property
    def count(self) -> int:
        """Samples seen by this rank since the last reset."""
        return self._count

    def compute(self) -> dict[str, float]:
        """The means over every rank's samples, by name in sorted order.

        Collective: every rank of the group calls it, also one that saw no samples (it counts
        for nothing). Ranks that updated different names raise `MetricMismatchError` on every
        rank. A name with no samples on any rank is NaN; no names anywhere give {}.
        """
        return reduce_means("Average.compute", self._sums, self._count, self.group, may_be_empty=True)
