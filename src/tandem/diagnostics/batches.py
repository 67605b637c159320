"""The latest batch handed out for training on this rank: its share of the step.

A loader (`td.partition_dataset`) or the script (`td.samples(n)`) records each batch here;
the data-parallel reducer reads it at the next backward to weight this rank's gradient by its
samples when the ranks' batches differ in size (see `tandem.parallel.data_parallel.samples`). It sits below
both, as `steps` (what `tandem scale` counts) does: one counter and three fields, no torch.
"""

from __future__ import annotations


class Latest:
    """The latest record of this process (`serial` counts records)."""

    serial = 0
    weight = 0.0  # this rank's share of the step (proportional to its samples)
    uneven = False  # whether the ranks' shares may differ: the step must be weighted
    code = 0  # what the weight is relative to, which the ranks must share: 1 (a count), or B


latest = Latest()


def record(weight: float, uneven: bool, code: int) -> None:
    """A batch was handed out: its share of the step (`weight`), and whether it is uneven."""
    latest.serial += 1
    latest.weight, latest.uneven, latest.code = weight, uneven, code
