"""Samples per rank: the weight of each rank's gradient when the ranks' batches differ.

    loader, _ = td.partition_dataset(data, batch_size=30, pad=False)   # 100 samples: 34/33/33
    for x, y in loader:                 # the loader tells the reducer each batch's size
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    for x, y in my_own_loader:          # any other loader: say it before backward
        td.samples(len(x))
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

One process averages the loss over the n samples of its batch. k ranks that each average over
their own m_k samples reproduce it only when their gradients are weighted by m_k / n (seed
003): the mean gradient is sum_k (m_k / n) grad l_k. The data-parallel reducer (reducer.py)
does exactly that, with no extra message and no host read: each rank scales its gradient by
its weight w_k (proportional to m_k) where it would scale by 1/size, puts w_k in bucket 0's
"contributed" element (the one `td.join` counts with, summed with the gradients anyway) and,
once the buckets are summed, divides them by that element: sum_k w_k g_k / sum_k w_k.

Who says how many samples a step had: the last *report* before each backward pass (kept in
`diagnostics/batches.py`, below both the loader and this package).

* `td.partition_dataset(..., pad=False)` reports every batch it hands out in grad mode (a batch
  read under `torch.no_grad()`, an evaluation, is not counted). Only a step whose global batch
  does not split evenly (the epoch's last, usually) is weighted; the other steps are reduced
  exactly as before, at no cost. Its weight is m_k / B (B: the global batch), so the summed
  gradients keep the size they have with 1/size.
* `td.samples(n)`: the explicit form, for loaders tandem did not make; weight n, every step.

Gradient accumulation: one process following torch's recipe (each micro-batch's mean loss
divided by the window's M micro-batches) weights every micro-batch alike, so each rank's part
of micro-batch j needs its own weight m_kj / n_j. ZeroOptimizer (`WindowSamples`: it rescales
what `.grad` holds when a micro-batch's weight differs from the one before) and fully_shard
(`PassSamples`: each pass's gradient is weighted as it joins the accumulated one) do exactly
that, and so does the data-parallel reducer (DistributedOptimizer, DDP: `WindowSamples` too,
its factor the scale of the gradients it moves into a bucket and its divisor the contributed
element); `td.partition_dataset` knows each n_j, `td.samples(n, total=n_j)` says it. A report
made before the wrapper was built does not count: it belongs to an earlier loop. A step
without a new report is reduced as before (the mean over ranks). Every rank must weight
alike: when argument checks are on, the per-step agreement (operation_check.py) names a rank that
weights a step the others do not.
Cost: one more pass over the gradients (the division) on a weighted step; none on the others.
Only op="mean" is weighted; op="sum" sums as it says.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from tandem.diagnostics.batches import latest, listen, record


def samples(n: int, total: int | None = None) -> None:
    """Weight this rank's next gradient reduction by `n`, the samples of its batch.

    For loaders tandem did not make (`td.partition_dataset(pad=False)` says it itself): call it
    before backward, on every rank, every step. The reduced gradient is then the average over
    all ranks' samples, as one process would compute over the whole batch.

    With gradient accumulation under `td.ZeroOptimizer` (several backward passes, each after
    its own `td.samples`), give `total` too when the micro-batches' global sizes differ: one
    process following torch's recipe (each micro-batch's mean loss divided by the number of
    micro-batches) weights micro-batches alike whatever their size, which needs each one's
    global count. Without it the window's gradient is the mean over all its samples, the same
    only when every micro-batch of the window has the same global size.

    Args:
        n: the number of samples this rank's loss averages over this step (>= 1).
        total: the samples of this step over all ranks (the same on every rank), if known.

    Raises:
        TypeError: `n` or `total` is not an integer.
        ValueError: `n` < 1 (a rank without data takes no step: use `td.join`), or `total` < n.
    """
    n = _count("n", n)
    if n < 1:
        raise ValueError(
            f"td.samples({n}) on rank-local data: a step needs at least one sample; a rank that "
            "has run out of data takes no step: run the loop inside `with td.join(opt):`")
    share = 0.0
    if total is not None:
        total = _count("total", total)
        if total < n:
            raise ValueError(f"td.samples({n}, total={total}): total counts every rank's samples "
                             f"of the step, this rank's {n} among them, so it is at least {n}")
        share = n / total
    record(float(n), True, 1, share)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"td.samples: {name} is a number of samples, an int; got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"td.samples: {name} is a number of samples, an int; got {value!r}") from None


class RoundSamples:
    """One reducer's view of the reports: its current round's total weight."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled  # op="mean" only
        self._seen = latest.serial  # what was handed out before this reducer is not its data
        self.reset()

    def reset(self) -> None:
        """A new round: nothing counted yet."""
        self.weight = 0.0
        self.weighted = False
        self.code = 0

    def update(self) -> None:
        """At each gradient: take a report that arrived since the last one."""
        if latest.serial != self._seen and self._enabled:
            self._seen = latest.serial
            self.weight += latest.weight
            if latest.uneven:
                self.weighted, self.code = True, latest.code

    def scale(self, default: float) -> float:
        """What this rank multiplies its gradients by: its weight, or `default` (1/size)."""
        return self.weight if self.weighted else default


class WindowSamples:
    """The reports of one accumulation window, for a wrapper whose gradients add up locally
    in `.grad` over several backward passes and are reduced once, at `step()` (ZeroOptimizer).

    One process following torch's accumulation recipe weights micro-batch j's gradient by
    1/M (M micro-batches), and the ranks' parts of it by m_kj / n_j (n_j: its global size).
    So each micro-batch's gradient needs its own factor f_kj = size * m_kj / n_j, relative to
    the plain mean over ranks (1 on an even micro-batch), and autograd has already added the
    earlier ones into `.grad`: when a report brings a new factor, what `.grad` holds is
    rescaled by old / new (a pass over the gradients, on uneven micro-batches only), so that
    `.grad` times the last factor is sum_j f_kj g_kj. Each rank also sends its factors' mean
    over the window; their sum is the divisor (the group's size when every share is known).
    A report that does not know its global size (`td.samples(n)` without total) has the
    factor m_kj: exact when every micro-batch of the window has the same global size, and a
    rank whose own counts differ within a window warns once (pass `total=`).
    """

    def __init__(self, size: int, grads: Callable[[], Iterable[Any]],
                 active: Callable[[], bool]) -> None:
        self.size = size  # the group's (ZeroOptimizer sets it again at each change of world)
        self._grads = grads  # the gradients autograd accumulates into
        self._active = active  # False once a newer wrapper took the parameters over
        self._warned = False
        self.reset()
        listen(self._report)  # from now on: earlier reports belong to an earlier loop

    def reset(self) -> None:
        """A new window: nothing counted; `.grad` (zeroed by the script) in units of 1."""
        self.factor = 1.0
        self.weighted = False  # an uneven report in this window: the reduction divides
        self.code = 0  # what its weights are relative to (the per-step agreement compares it)
        self._factors = 0.0
        self._reports = 0
        self._counts: set[float] = set()

    def _report(self) -> None:
        if not self._active():  # an earlier loop's wrapper: its window is over for good
            return
        if latest.uneven:
            self.weighted, self.code = True, latest.code
        factor = report_factor(self.size)
        if latest.uneven and not latest.share:
            self._counts.add(latest.weight)
        if factor != self.factor:
            for grad in self._grads():
                grad.mul_(self.factor / factor)
            self.factor = factor
        self._factors += factor
        self._reports += 1

    def divisor(self) -> float:
        """This rank's part of the summed divisor: its factors' mean over the window (at the
        step that reduces it: a warning if its counts differed without their global sizes)."""
        if len(self._counts) > 1 and not self._warned:
            self._warned = True
            warnings.warn(
                f"td.samples: this rank's micro-batches of one accumulation window had "
                f"{sorted(self._counts)} samples; without their global sizes the window's "
                f"gradient is the mean over all its samples, not torch's recipe (each "
                f"micro-batch's mean / M) that one process would follow: pass "
                f"td.samples(n, total=<the step's samples over all ranks>)", stacklevel=4)
        return self._factors / self._reports if self._reports else 1.0


def report_factor(size: int) -> float:
    """The latest report's factor against the plain mean over `size` data-parallel ranks: 1
    on an even step, size * m_k / n on an uneven one whose global size n is known (the ranks'
    factors then sum to `size`, as on an even step), m_k (a count) when it is not."""
    if not latest.uneven:
        return 1.0
    return latest.share * size if latest.share else latest.weight


class PassSamples:
    """The reports of one accumulation window, for a reduction that sees each backward pass's
    gradient as it is made (fully_shard's units): each pass's gradient is multiplied by its
    own report's factor (`report_factor`) before it joins the others, and the rank's divisor
    is its factors' mean over the window, as `WindowSamples` (whose rescaling this needs not).
    A pass with no report since the one before is even (factor 1)."""

    def __init__(self) -> None:
        self._seen = latest.serial  # what was handed out before this reduction is not its data
        self._sum = 0.0
        self._passes = 0

    def factor(self, size: int) -> float:
        """This backward pass's factor; call it once per pass."""
        factor = 1.0
        if latest.serial != self._seen:
            self._seen = latest.serial
            factor = report_factor(size)
        self._sum += factor
        self._passes += 1
        return factor

    def divisor(self) -> float:
        """This rank's part of the summed divisor, and a new window."""
        mean = self._sum / self._passes if self._passes else 1.0
        self._sum, self._passes = 0.0, 0
        return mean
