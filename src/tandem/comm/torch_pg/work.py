"""What torch sees of a tandem operation: a `Work` whose waits go through the watchdog, and
torch's reduction ops in tandem's words.

`TandemWork` wraps the engine's works (already watched: `watchdog.WatchedWork`) and the step
that finishes the operation for torch (copy a staged result out, divide for AVG). `wait()` is
the watched wait, so a rank that never joins a collective is named by the watchdog, not waited
for until torch's 30-minute default. `get_future()` completes the operation (or raises) before it
returns its future: torch's C++ callers (DDP's reducer, functional collectives) wait on the future
alone, and no thread of ours could complete it meanwhile without driving MPI from a second
thread. DDP's buckets are therefore reduced as they are issued, not overlapped with backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.engines.backend import Work

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}
_BITWISE = ("band", "bor", "bxor")


class UnsupportedOperation(RuntimeError):
    """torch asked the tandem backend for something it does not do; the message says instead what."""


def reduce_op(op: Any, dtype: torch.dtype, collective: str) -> tuple[str, bool]:
    """(tandem's op, divide afterwards) for torch's `op` on tensors of `dtype`.

    AVG is a sum divided by the group's size, for floating and complex tensors (Gloo has none
    at all); PREMUL_SUM is NCCL's alone.
    """
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise UnsupportedOperation(
                f"{collective} with ReduceOp.AVG on {dtype}: an integer average would round; "
                "use ReduceOp.SUM and divide (with the rounding you want) afterwards")
        return "sum", True
    name = _OPS.get(kind)
    if name is None:
        raise UnsupportedOperation(
            f"{collective} with ReduceOp.{getattr(kind, 'name', kind)} is not supported by the "
            "tandem backend (PREMUL_SUM is NCCL's): multiply the tensor by the factor and use "
            "ReduceOp.SUM")
    if name in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedOperation(
            f"{collective} with ReduceOp.{name.upper()} on {dtype}: bitwise reductions take "
            "integer or bool tensors; use MIN/MAX, or view the bits as an integer dtype")
    return name, False


def seconds(timeout: Any, default: float) -> float:
    """torch's wait timeout (a timedelta; zero means none given) in seconds."""
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return default


class TandemWork(dist._Work):
    """Engine works (watched) plus the step that finishes them; `result` goes in the future."""

    def __init__(self, works: Sequence[Work], timeout: float, result: Any = None,
                 after: Callable[[], None] | None = None, source: int = -1,
                 check: Callable[[], None] | None = None, order: Any = None) -> None:
        super().__init__()
        self._works = list(works)
        # The argument check posted with an asynchronous call, read before the result is
        # handed over; the group's queue of collectives, finished in order (`torch_order`).
        self._check, self._order = check, order
        if order is not None:
            order.add(self)
        self._timeout = timeout
        self._result = [] if result is None else result
        self._after = after
        self._source = source
        self._error: BaseException | None = None
        self._done = False

    def _finish(self, timeout: float) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            return
        order, self._order = self._order, None
        if order is not None:
            order.finish_through(self, timeout)  # an earlier work's error is raised there, once
        try:
            check, self._check = self._check, None
            if check is not None:
                check()
            while self._works:
                self._works[0].wait(timeout)
                self._works.pop(0)
            if self._after is not None:
                self._after()
        except BaseException as error:
            self._error = error
            raise
        self._done = True

    def finish_in_order(self, timeout: float) -> None:
        """Finish this work for a later one of its group (`torch_order.InOrder`)."""
        self._order = None
        self._finish(timeout)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._finish(seconds(timeout, self._timeout))
        return True

    def get_future(self) -> torch.futures.Future:
        # A failure is raised here, not set on the future: DDP's reducer crashed the process
        # (SIGSEGV) on a future that held an exception, and passes one raised here on to
        # `loss.backward()` as it is.
        self._finish(self._timeout)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        if self._order is not None and not self._order.ready(self):
            return False
        if not self._done and self._error is None and all(w.is_completed() for w in self._works):
            self._finish(self._timeout)
        return self._done or self._error is not None

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        """Nothing to order on a stream: the result is in place once `wait()` returned."""


def done(result: Any = None) -> TandemWork:
    """A work that has nothing left to do (a group of one, empty tensors)."""
    return TandemWork((), 0.0, result)
