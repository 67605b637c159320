"""Step timing: where each training step's time went, kept per process at almost no cost.

The data-parallel optimizer calls `step_done(comm_s)` at the end of every `step()`, with the
time it spent blocked waiting for gradient reductions (communication that backward did not
hide: *exposed* communication). The partitioned loader calls `add_batch(seconds, samples)`
for every batch it hands out, with the time the script spent waiting for it. From those two
calls each step gets a record:

* ``wall_s``   time from the end of the previous `step()` to the end of this one (the first
  `step()` only starts the clock, so it has no record);
* ``comm_s``   exposed communication, as reported by the optimizer;
* ``data_s``   time spent waiting for batches since the previous step;
* ``samples``  samples this rank processed in the step: `td.metrics.report(samples=N)` when the script
  said so, else what the partitioned loader handed out since the previous step, else 0.

Compute is what is left: ``wall_s - comm_s - data_s``. Nothing here synchronises a device or
allocates per step: records go into preallocated arrays (a ring of the last `CAPACITY` steps).

`tandem scale` drives a job through this module: with `TANDEM_SCALE_STEPS=N` every rank stops
(`SystemExit(0)`) at the end of its `WARMUP + N`-th recorded step, after writing its records to
`TANDEM_SCALE_OUT/rank<r>.json`; all ranks step in lockstep, so they stop at the same step.
With `TANDEM_SCALE_MODE=weak`, `scaled_batch` (used by `td.partition_dataset`) turns the
script's global batch into a per-rank batch: the global batch grows with the world size.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from array import array
from dataclasses import dataclass

from tandem.diagnostics import timeline
from tandem.job import settings

CAPACITY = 4096  # steps kept; older ones are overwritten (bounded memory for endless jobs)

_wall = array("d", bytes(8 * CAPACITY))
_comm = array("d", bytes(8 * CAPACITY))
_data = array("d", bytes(8 * CAPACITY))
_samples = array("q", bytes(8 * CAPACITY))
_count = 0  # steps recorded so far (may exceed CAPACITY)
_last_end: float | None = None  # perf_counter() at the end of the previous step
_pending_data_s = 0.0  # batch waits since the previous step
_pending_samples = 0  # samples handed out by the loader since the previous step
_pending_comm_s = 0.0  # communication waits reported by wrappers since the previous step
_reported: int | None = None  # td.metrics.report(samples=N), sticky until changed
_plan: ScalePlan | None = None
_plan_read = False


@dataclass(frozen=True)
class StepRecord:
    """One step of one rank; `compute_s` is the wall time not spent on communication or data."""

    wall_s: float
    comm_s: float
    data_s: float
    samples: int

    @property
    def compute_s(self) -> float:
        return max(0.0, self.wall_s - self.comm_s - self.data_s)

    def as_dict(self) -> dict[str, float]:
        return {"wall_s": self.wall_s, "comm_s": self.comm_s, "data_s": self.data_s,
                "samples": self.samples}


@dataclass(frozen=True)
class ScalePlan:
    """What `tandem scale` asked this rank to do (from `TANDEM_SCALE_*`)."""

    steps: int
    warmup: int
    out: str
    mode: str

    @classmethod
    def from_environment(cls) -> ScalePlan | None:
        told = settings.current()  # parsed and checked there (both set, or neither)
        if told.scale_steps is None:
            return None
        return cls(told.scale_steps, told.scale_warmup, told.scale_out, told.scale_mode)


def scale_mode() -> str:
    """`"strong"` (the default: the global batch stays fixed) or `"weak"` (TANDEM_SCALE_MODE)."""
    return settings.current().scale_mode


def scaled_batch(batch_size: int, size: int) -> int:
    """The global batch to use: `batch_size`, times `size` in weak-scaling mode.

    In weak mode each rank keeps the batch a single process would use, so the script's
    `batch_size` becomes the per-rank batch and the global batch grows with the world.
    """
    if scale_mode() != "weak" or not isinstance(batch_size, int) or isinstance(batch_size, bool):
        return batch_size  # bad values are left for the caller's own check to report
    return batch_size * size


# --- the hot path ----------------------------------------------------------------------------


def add_batch(seconds: float, samples: int) -> None:
    """The loader handed out a batch of `samples` after the script waited `seconds` for it."""
    global _pending_data_s, _pending_samples
    _pending_data_s += seconds
    _pending_samples += samples


def add_comm(seconds: float) -> None:
    """A wrapper waited `seconds` for communication (fully_shard's gathers and reductions, a
    ZeroOptimizer's step): counted into the current step's exposed communication."""
    global _pending_comm_s
    _pending_comm_s += seconds


def step_done(comm_s: float = 0.0, now: float | None = None) -> None:
    """End of one optimizer step, which waited `comm_s` seconds for communication (plus what
    `add_comm` collected); `now` is the caller's `time.perf_counter()` reading at the step's
    end, when it already took one."""
    global _count, _last_end, _pending_data_s, _pending_samples, _pending_comm_s
    comm_s, _pending_comm_s = comm_s + _pending_comm_s, 0.0
    if now is None:
        now = time.perf_counter()
    if _last_end is not None:
        slot = _count % CAPACITY
        _wall[slot] = now - _last_end
        _comm[slot] = comm_s
        _data[slot] = _pending_data_s
        _samples[slot] = _reported if _reported is not None else _pending_samples
        _count += 1
    _last_end = now
    _pending_data_s = 0.0
    _pending_samples = 0
    if timeline.ENABLED:
        timeline.step_finished()
    if not _plan_read:
        _read_plan()
    if _plan is not None and _count >= _plan.warmup + _plan.steps:
        write_records(_plan)
        raise SystemExit(0)  # every rank reaches this same step: the job ends together


def report(samples: int) -> None:
    """Say how many samples this rank processes per step (sticky until called again).

    Needed for throughput when batches do not come from `td.partition_dataset` (which counts
    them itself). Call it once before the loop, or every step when batches vary.

    Args:
        samples: the samples this rank processes per step (an int >= 0).

    Raises:
        TypeError: `samples` is not an int.
        ValueError: `samples` is negative.
    """
    global _reported
    if not isinstance(samples, int) or isinstance(samples, bool):
        raise TypeError(f"td.metrics.report(samples=...) takes an int, got {samples!r}")
    if samples < 0:
        raise ValueError(f"td.metrics.report(samples={samples}): give the number of samples, >= 0")
    _reported = samples


# --- reading ---------------------------------------------------------------------------------


def records() -> list[StepRecord]:
    """The recorded steps, oldest first (the last `CAPACITY` of them)."""
    first = max(0, _count - CAPACITY)
    return [
        StepRecord(_wall[i % CAPACITY], _comm[i % CAPACITY], _data[i % CAPACITY],
                   int(_samples[i % CAPACITY]))
        for i in range(first, _count)
    ]


def recorded() -> int:
    """How many steps were recorded so far (older ones than the last `CAPACITY` are gone)."""
    return _count


def reset() -> None:
    """Forget every record and setting (for tests, and between phases of a script)."""
    global _count, _last_end, _pending_data_s, _pending_samples, _reported, _plan, _plan_read
    _count, _last_end, _pending_data_s, _pending_samples = 0, None, 0.0, 0
    _reported, _plan, _plan_read = None, None, False


def _read_plan() -> None:
    global _plan, _plan_read
    _plan_read = True
    _plan = ScalePlan.from_environment()
    if _plan is not None:
        # A script that ends before the planned steps still leaves what it measured.
        atexit.register(_write_at_exit, _plan)


def _write_at_exit(plan: ScalePlan) -> None:
    if not os.path.exists(_rank_path(plan)):
        write_records(plan)


def _rank() -> tuple[int, int]:
    from tandem import runtime

    if runtime.is_initialized():
        world = runtime.world()
        return world.rank, world.size
    return 0, 1


def _rank_path(plan: ScalePlan) -> str:
    return os.path.join(plan.out, f"rank{_rank()[0]}.json")


def write_records(plan: ScalePlan) -> str:
    """Write this rank's records for `tandem scale` (atomically); return the file's path."""
    rank, size = _rank()
    kept = records()
    body = {
        "rank": rank, "size": size, "mode": plan.mode, "warmup": plan.warmup,
        "planned_steps": plan.steps, "recorded": _count,
        "steps": [record.as_dict() for record in kept],
    }
    os.makedirs(plan.out, exist_ok=True)
    path = _rank_path(plan)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        json.dump(body, file)
    os.replace(temporary, path)
    return path
