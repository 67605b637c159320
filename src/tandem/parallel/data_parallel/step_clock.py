"""Per-step timing of the data-parallel wrappers (`last_step_stats`), from host clocks only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    """Timing of one step, from host clocks only (no device synchronisation)."""

    step: int
    wall_s: float  # since the previous step finished: one whole iteration (nan for the first)
    comm_wait_s: float  # blocked waiting for gradient communication
    optimizer_s: float  # in the wrapped optimizer's step (0 for the module wrapper)
    bytes_reduced: int  # bytes this rank handed to the reduction (0 without communication)


class StepClock:
    """The last step's `StepStats`, from the end time each step reports."""

    def __init__(self) -> None:
        self.steps = 0
        self.last_end: float | None = None
        self.last: StepStats | None = None

    def record(self, end: float, wait_s: float, optimizer_s: float, nbytes: int) -> None:
        wall = end - self.last_end if self.last_end is not None else float("nan")
        self.last = StepStats(self.steps, wall, wait_s, optimizer_s, nbytes)
        self.steps += 1
        self.last_end = end
