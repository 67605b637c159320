"""How Horovod's operations run on tandem: named handles, posting order, and `join`.

Horovod posts an operation and lets a background thread start it once every rank has posted
the same name. tandem has no such thread, so this front end keeps the two things that scripts
and Horovod's tests rely on:

- **Posting order.** `allreduce_async` & co. record the operation; it starts at the next
  call that needs it (`synchronize`, `poll`, or any blocking collective), together with every
  operation posted before it, in posting order. A rank may thus post an operation and then
  enter a barrier that the other rank reaches before posting its own (Horovod's
  `*_duplicate_name_error` tests do): nothing has been sent yet, so nothing is mismatched.
- **Names.** `name=` identifies an operation in flight: posting a second one with the name of
  one not yet synchronized is a `ValueError` on that rank, as in Horovod.

**Join.** A rank that called `hvd.join()` must answer whatever the others still run. So every
operation on the global process set starts with a small *negotiation*: one all-reduce (max)
of a fixed-size vector holding, per rank, a "joined" flag, and the operation's description
(kind, dtype, op, root, shape) as its maximum and its negated minimum. A joined rank posts
flags only. From the result every rank learns the same things at once: whether the ranks
agree (if not, every rank raises `HorovodMismatchError` naming what each passed, as Horovod
raises a RuntimeError), who has joined, and what the active ranks are running. Joined ranks
answer an allreduce with zeros of the described shape (Horovod's semantics: an average still
divides by the full size); an allgather, broadcast, alltoall or reducescatter cannot be
answered, so the active ranks raise an error that says so. When every flag is set, `join`
returns on every rank the highest of the ranks that joined last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tandem import runtime
from tandem.comm.agreement import CollectiveMismatchError
from tandem.comm.backend import on_wire
from tandem.comm.collectives import allgather_object
from tandem.horovod import timeline
from tandem.horovod.basics import HorovodMismatchError

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
_OPS = ("sum", "mean", "min", "max", "product")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DIMS = 8
# kind, dtype, op, root, ndim, then the shape (dim 0 is not compared where it may differ)
_FIELDS = 5 + _DIMS
_ABSENT = -(2**62)  # what a joined rank posts for every field: never the max


class Description:
    """What an operation is, in the fields that the ranks compare and joined ranks rebuild."""

    def __init__(self, kind: str, tensor: torch.Tensor, op: str = "sum", root: int = -1) -> None:
        self.kind, self.dtype, self.op, self.root = kind, tensor.dtype, op, root
        self.shape = tuple(tensor.shape)

    def fields(self) -> list[int]:
        shape = list(self.shape)
        if self.kind in ("allgather", "alltoall") and shape:
            shape[0] = -1  # first dimensions may differ
        if len(shape) > _DIMS:  # fold the tail: still equal exactly when the shapes agree
            shape = shape[: _DIMS - 1] + [int(torch.tensor(shape[_DIMS - 1:]).prod())]
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else 99
        return [KINDS.index(self.kind), dtype, _OPS.index(self.op), self.root, len(self.shape),
                *shape, *([-1] * (_DIMS - len(shape)))]

    def __str__(self) -> str:
        root = f", root={self.root}" if self.kind == "broadcast" else ""
        op = f", op={self.op}" if self.kind in ("allreduce", "reducescatter") else ""
        return f"{self.kind}(shape={list(self.shape)}, dtype={self.dtype}{op}{root})"


def _decode(fields: list[int]) -> tuple[str, torch.dtype, str, list[int]]:
    kind, dtype, op, _root, ndim = fields[:5]
    return KINDS[kind], _DTYPES[dtype], _OPS[op], fields[5 : 5 + ndim]


class _State:
    joined_before: list[int] = []  # the flags seen at the previous negotiation
    starting: HorovodHandle | None = None  # the handle whose operation is being started


def _negotiate(mine: Description | None) -> tuple[list[int], list[int] | None, bool]:
    """One round: (joined flags, the agreed fields or None when nobody is active, agreement)."""
    n, me = runtime.size(), runtime.rank()
    flags = [0] * n
    if mine is None:
        flags[me] = 1
        fields = [_ABSENT] * (2 * _FIELDS)
    else:
        own = mine.fields()
        fields = own + [-value for value in own]
    backend = runtime.get_backend()
    message = on_wire(torch.tensor(flags + fields, dtype=torch.int64), backend)
    backend.allreduce(message, "max", None).wait(runtime.state().timeout)
    values = message.tolist()
    joined, high, low = values[:n], values[n : n + _FIELDS], values[n + _FIELDS :]
    if all(joined):
        return joined, None, True
    agreed = all(h == -lo for h, lo in zip(high, low, strict=True))
    return joined, high, agreed


def _mismatch(mine: Description | None) -> HorovodMismatchError:
    """Every rank calls this on the same round: one exchange of readable descriptions."""
    described = allgather_object(None if mine is None else str(mine))
    lines = "\n".join(f"  rank {r}: {'(joined)' if d is None else d}" for r, d in enumerate(described))
    return HorovodMismatchError(
        f"ranks called a collective with different arguments:\n{lines}\n"
        "Make every rank pass the same shape, dtype, op and root (a name= is matched by order "
        "here, not by name)."
    )


def negotiate(mine: Description) -> None:
    """Before an operation on the global set: agree on it, and refuse what joined ranks can't do."""
    begin = time.time_ns() // 1000
    joined, _fields, agreed = _negotiate(mine)
    handle = _State.starting
    if handle is not None:
        handle.kind = mine.kind
        timeline.span(mine.kind, handle.name, f"NEGOTIATE_{mine.kind.upper()}", begin,
                      time.time_ns() // 1000)
    _State.joined_before = joined
    if not agreed:
        raise _mismatch(mine)
    if any(joined) and mine.kind != "allreduce":
        ranks = [r for r, flag in enumerate(joined) if flag]
        raise RuntimeError(
            f"rank {runtime.rank()}: {mine} cannot run: rank(s) {ranks} called hvd.join() and "
            "can only answer allreduce (as in Horovod); run it before join or on every rank"
        )


def join_rounds(answer_allreduce: Callable[[torch.dtype, list[int], str], None]) -> int:
    """The joined rank's loop: answer negotiations until every rank has joined."""
    before = _State.joined_before or [0] * runtime.size()
    while True:
        joined, fields, agreed = _negotiate(None)
        if fields is None:  # everyone has joined: the last ones are those new this round
            newly = [r for r, flag in enumerate(joined) if flag and not before[r]]
            _State.joined_before = []
            return max(newly) if newly else runtime.size() - 1
        before = joined
        if not agreed:
            _mismatch(None)  # the active ranks raise it; this rank keeps answering
            continue
        kind, dtype, op, shape = _decode(fields)
        if kind == "allreduce":
            answer_allreduce(dtype, shape, op)


# -- handles ----------------------------------------------------------------------------------
class _Ready:
    """An already computed result, with a Handle's interface."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self.value


class HorovodHandle:
    """An operation posted by `*_async`: started in posting order, finished by `synchronize`."""

    def __init__(self, name: str | None, start: Callable[[], Any],
                 finish: Callable[[Any], Any] | None = None) -> None:
        self.name = name
        self.kind: str | None = None  # known once negotiated (global set only)
        self._begun = 0
        self._start, self._finish = start, finish
        self._work: Any = None
        self._error: BaseException | None = None

    def _begin(self) -> None:
        if self._work is None and self._error is None:
            self._begun = time.time_ns() // 1000
            _State.starting = self
            try:
                self._work = self._start()
            except CollectiveMismatchError as error:
                self._error = (error if isinstance(error, RuntimeError)
                               else HorovodMismatchError(str(error)))
            except Exception as error:  # raised where the script synchronizes, as in Horovod
                self._error = error
            finally:
                _State.starting = None

    def done(self) -> bool:
        return self._error is not None or (self._work is not None and self._work.done())

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        value = self._work.wait()
        if self.kind is not None and timeline.recording():
            timeline.span(self.kind, self.name, self.kind.upper(), self._begun,
                          time.time_ns() // 1000)
        return value if self._finish is None else self._finish(value)


_pending: list[HorovodHandle] = []
_in_flight: dict[str, HorovodHandle] = {}


def post(name: str | None, start: Callable[[], Any],
         finish: Callable[[Any], Any] | None = None) -> HorovodHandle:
    """Record an operation; it starts at the next `start_pending()`."""
    if name is not None and name in _in_flight:
        raise ValueError(
            f"rank {runtime.rank()}: an operation named {name!r} is already in flight; "
            "synchronize it first or give this one another name"
        )
    handle = HorovodHandle(name, start, finish)
    _pending.append(handle)
    if name is not None:
        _in_flight[name] = handle
    return handle


def start_pending() -> None:
    while _pending:
        _pending.pop(0)._begin()


def ready(value: Any) -> _Ready:
    return _Ready(value)


def synchronize(handle: HorovodHandle) -> Any:
    """Wait for an operation posted by `*_async` and return its result."""
    if not isinstance(handle, HorovodHandle):
        if hasattr(handle, "wait"):  # a tandem Handle
            return handle.wait()
        raise TypeError(f"synchronize() takes a handle from an *_async call, got {handle!r}")
    start_pending()
    try:
        return handle.result()
    finally:
        if handle.name is not None and _in_flight.get(handle.name) is handle:
            del _in_flight[handle.name]


def poll(handle: HorovodHandle) -> bool:
    """True once the operation has completed (`synchronize` will not block)."""
    if not isinstance(handle, HorovodHandle):
        return handle.done()
    start_pending()
    return handle.done()


def run(name: str | None, start: Callable[[], Any],
        finish: Callable[[Any], Any] | None = None) -> Any:
    """A blocking operation: posted after the pending ones and waited for."""
    return synchronize(post(name, start, finish))


def forget() -> None:
    """At shutdown: operations never synchronized are dropped, as Horovod drops them."""
    _pending.clear()
    _in_flight.clear()
    _State.joined_before = []
