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

Reports of one accumulation window (`accumulate=k`, `no_sync()`) add up (exact when its
micro-batches are equal); each report counts once, however many backward passes follow it. A
report made before the reducer (the DistributedOptimizer or DistributedDataParallel) was built
does not count: it belongs to an earlier loop. A step without a new report is reduced as
before (the mean over ranks). Every rank must weight alike: when argument checks are on, the
per-step agreement (step_check.py) names a rank that weights a step the others do not.
Cost: one more pass over the gradients (the division) on a weighted step; none on the others.
Only op="mean" is weighted; op="sum" sums as it says.
"""

from __future__ import annotations

import operator

from tandem.diagnostics.batches import latest, record


def samples(n: int) -> None:
    """Weight this rank's next gradient reduction by `n`, the samples of its batch.

    For loaders tandem did not make (`td.partition_dataset(pad=False)` says it itself): call it
    before backward, on every rank, every step. The reduced gradient is then the average over
    all ranks' samples, as one process would compute over the whole batch.

    Args:
        n: the number of samples this rank's loss averages over this step (>= 1).

    Raises:
        TypeError: `n` is not an integer.
        ValueError: `n` < 1 (a rank without data takes no step: use `td.join`).
    """
    if isinstance(n, bool):
        raise TypeError(f"td.samples(n) takes the number of samples, an int; got {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"td.samples(n) takes the number of samples, an int; got {n!r}") from None
    if n < 1:
        raise ValueError(
            f"td.samples({n}) on rank-local data: a step needs at least one sample; a rank that "
            "has run out of data takes no step: run the loop inside `with td.join(opt):`")
    record(float(n), True, 1)


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
