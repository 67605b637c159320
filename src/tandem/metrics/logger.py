"""`td.metrics.MetricLogger`: scalars averaged over the ranks, written by rank 0 to TensorBoard and CSV.

    logger = td.metrics.MetricLogger("runs/digits")          # collective: every rank constructs it
    for step, (x, y) in enumerate(loader):
        ...
        if step % 50 == 0:
            logger.log(step, loss=loss.item(), timing=True)   # collective: every rank logs
    logger.close()

Each `log()` is one reduction (`means`: the ranks agree on the names, then sum), so rank 0
writes the mean over the ranks; the other ranks write nothing. Ranks that pass different names
(rank 0 `loss`, rank 1 `acc`) get a `MetricMismatchError` on every rank that names each rank's
names, instead of a row that mixes them. With `timing=True` it also logs the steps since the
previous `log()` as `tandem scale` measures them (`diagnostics.steps`): ``samples_per_s`` (the
whole job's), and the mean step's ``time/compute_s``, ``time/comm_s`` (exposed communication)
and ``time/data_s``, in the same reduction. A CSV file (``metrics.csv``: step, wall_time, one
column per name) is always written; TensorBoard event files are written through
`torch.utils.tensorboard` when the `tensorboard` package is installed
(``pip install tandem[tensorboard]``).

A log directory that cannot be written is an error at construction, on every rank, before
any training time is spent; so is a value that is not a number, at the `log()` that passes it.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import numbers
import os
import time
from typing import Any

import torch

from tandem import runtime
from tandem.comm.collectives import user as collectives
from tandem.comm.groups import Group, group_rank
from tandem.diagnostics import steps
from tandem.metrics.means import reduce_means

CSV_NAME = "metrics.csv"
_FIXED = ("step", "wall_time")


def tensorboard_available() -> bool:
    """Whether the `tensorboard` package (needed by `torch.utils.tensorboard`) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def _number(name: str, value: Any) -> float:
    """`value` as a float, or a TypeError that names it and says what to pass instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.detach().item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(
        f"MetricLogger.log: {name}={value!r} ({type(value).__name__}) is not a number; "
        f"pass an int, a float or a one-element tensor (e.g. {name}=loss.item())"
    )


class MetricLogger:
    """Scalars averaged over the ranks of `group`, written by its first rank to `log_dir`.

    `tensorboard`: None writes event files when the package is installed, True requires it,
    False writes the CSV file only. Constructing and `log()` are collective over `group`.

    Args:
        log_dir: the directory the first rank writes `metrics.csv` (and event files) into;
            created if missing, appended to when it holds a previous run's CSV.
        tensorboard: as above.
        group: the ranks whose values are averaged (None: the world).

    Raises:
        ModuleNotFoundError: `tensorboard=True` without the tensorboard package.
        PermissionError: the first rank cannot create or write `log_dir` (raised on every rank
            of the group).
    """

    def __init__(self, log_dir: str | os.PathLike, tensorboard: bool | None = None,
                 group: Group | None = None) -> None:
        self.log_dir = os.fspath(log_dir)
        self.group = group
        self._writes = not runtime.is_initialized() or group_rank(group) == 0
        if tensorboard and not tensorboard_available():
            raise ModuleNotFoundError(
                "MetricLogger(tensorboard=True) needs the tensorboard package: "
                "pip install 'tandem[tensorboard]' (or pass tensorboard=None to skip it when missing)"
            )
        self.tensorboard = tensorboard_available() if tensorboard is None else tensorboard
        self._writer: Any = None
        self._columns: list[str] = []
        self._seen_steps = steps.recorded()
        error = self._open() if self._writes else None
        if runtime.is_initialized() and runtime.size() > 1:  # every rank fails, not only rank 0
            root = 0 if group is None else group.ranks[0]
            error = collectives.broadcast_object(error, root=root, group=group)
        if error:
            raise PermissionError(error)

    @property
    def csv_path(self) -> str:
        return os.path.join(self.log_dir, CSV_NAME)

    def _open(self) -> str | None:
        """Create the directory and files (first rank); the error message, or None."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            if os.path.exists(self.csv_path):  # resuming: keep the rows, append with the same columns
                with open(self.csv_path, newline="") as f:
                    header = next(csv.reader(f), [])
                self._columns = [c for c in header if c not in _FIXED]
            with open(self.csv_path, "a"):
                pass
            if self.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(self.log_dir, flush_secs=10)
        except OSError as exc:
            return (f"MetricLogger cannot write to log directory {self.log_dir!r}: {exc}; "
                    f"pass a directory this job may create and write (e.g. one under $HOME)")
        return None

    def log(self, step: int, *, timing: bool = False, **values: Any) -> dict[str, float]:
        """Average `values` over the ranks and write them at `step`; return the averages.

        Collective: every rank calls it with the same names (else `MetricMismatchError` on
        every rank, naming them). With `timing=True`, also logs samples_per_s and the mean
        step's compute/comm/data seconds since the previous call.
        """
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            raise TypeError(f"MetricLogger.log: step={step!r} must be an int (the training step)")
        numbers_ = {name: _number(name, value) for name, value in values.items()}
        if timing:
            numbers_.update(self._timing())
        # Every rank weighs 1: the mean over the ranks, in one reduction.
        means = reduce_means("MetricLogger.log", numbers_, 1, self.group, may_be_empty=False)
        if self._writes:
            self._write(int(step), means)
        return means

    def _timing(self) -> dict[str, float]:
        recorded = steps.recorded()
        new = min(recorded - self._seen_steps, steps.CAPACITY)
        self._seen_steps = recorded
        records = steps.records()[-new:] if new > 0 else []
        wall = sum(r.wall_s for r in records)
        n = max(len(records), 1)
        size = runtime.size() if runtime.is_initialized() else 1
        return {
            # each rank's rate times the ranks: the mean over ranks is the job's throughput
            "samples_per_s": (sum(r.samples for r in records) / wall * size) if wall else math.nan,
            "time/compute_s": sum(r.compute_s for r in records) / n,
            "time/comm_s": sum(r.comm_s for r in records) / n,
            "time/data_s": sum(r.data_s for r in records) / n,
        }

    def _write(self, step: int, means: dict[str, float]) -> None:
        now = time.time()
        if self._writer is not None:
            for name, value in means.items():
                self._writer.add_scalar(name, value, step, walltime=now)
        new = [name for name in means if name not in self._columns]
        if new:  # a name not seen before: widen the file (rare; keeps one table)
            self._columns += new
            self._rewrite_header()
        with open(self.csv_path, "a", newline="") as f:
            row = [step, f"{now:.3f}"] + [_cell(means.get(c)) for c in self._columns]
            csv.writer(f).writerow(row)

    def _rewrite_header(self) -> None:
        with open(self.csv_path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        width = len(_FIXED) + len(self._columns)
        with open(self.csv_path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(list(_FIXED) + self._columns)
            writer.writerows(row + [""] * (width - len(row)) for row in rows)

    def flush(self) -> None:
        """Write buffered TensorBoard events now (the CSV file is written on every `log()`)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cell(value: float | None) -> str:
    return "" if value is None else repr(value)
