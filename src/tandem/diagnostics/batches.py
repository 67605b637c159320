"""The latest batch handed out for training on this rank: its share of the step.

A loader (`td.partition_dataset`) or the script (`td.samples(n)`) records each batch here;
the data-parallel reducer reads it at the next backward to weight this rank's gradient by its
samples when the ranks' batches differ in size (see `tandem.parallel.data_parallel.samples`). It sits below
both, as `steps` (what `tandem scale` counts) does: one counter and four fields, no torch.
Whoever accumulates gradients locally across reports (ZeroOptimizer) listens: it must rescale
what it holds before the next backward pass adds the new micro-batch's gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class Latest:
    """The latest record of this process (`serial` counts records)."""

    serial = 0
    weight = 0.0  # this rank's share of the step (proportional to its samples)
    uneven = False  # whether the ranks' shares may differ: the step must be weighted
    code = 0  # what the weight is relative to, which the ranks must share: 1 (a count), or B
    share = 0.0  # m_k / n_step, this rank's exact part of the step's global batch; 0: unknown


latest = Latest()
_listeners: list[weakref.WeakMethod] = []


def listen(method: Callable[[], None]) -> None:
    """Call the bound `method` after each record (held weakly: its object may go)."""
    _listeners.append(weakref.WeakMethod(method))


def record(weight: float, uneven: bool, code: int, share: float = 0.0) -> None:
    """A batch was handed out: its share of the step (`weight`), whether it is uneven, and
    (when the loader knows the step's global batch) its exact part of it, `share`."""
    latest.serial += 1
    latest.weight, latest.uneven, latest.code, latest.share = weight, uneven, code, share
    if _listeners:
        for ref in list(_listeners):
            method = ref()
            if method is None:
                _listeners.remove(ref)
            else:
                method()
