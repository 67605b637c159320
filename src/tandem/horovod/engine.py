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

**Negotiation and join.** Every operation on the global process set starts with one
negotiation, which is tandem's agreement (`tandem.comm.agreement.agree`: the same fixed-size message
as every other agreement, so a rank in another operation is named, never misread): its codes
are the operation's description (kind, dtype, op, root, shape), a "joined" flag and, from
ranks that called `hvd.join()`, how many rounds they have answered. Ranks that agree then hand the
data straight to the engine: one negotiation and one message per operation (`td.allreduce`'s
own argument check is not run again). A rank in `hvd.join()` answers as td.join's ranks out of
data do: it takes part in every agreement with no say in the description (`NO_SAY`), learns
from the result what the others run (a rank in another kind of operation differs from it, and
every rank raises), and answers an allreduce with zeros (Horovod's semantics:
an average still divides by the full size); an allgather, broadcast, alltoall or reducescatter
cannot be answered, so the active ranks raise an error that says so. When no rank is active
any more, every rank has its answer from that last round: the last rank to join is the one
that had answered the fewest rounds (the highest of those), as td.join's ranks learn together
from one all-reduce who stepped the most.
Ranks that disagree raise `HorovodMismatchError` naming what each passed (Horovod raises a
RuntimeError there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement.agree import NO_SAY, CollectiveMismatchError
from tandem.horovod import timeline
from tandem.horovod.basics import HorovodMismatchError

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "reduce")
_OPS = ("sum", "mean", "min", "max", "product")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DIMS = 8
_HOROVOD = agreement.checksum("horovod operation")
# The codes: who (0), kind, dtype, op, root, ndim (1-5), the shape (6-13, dim 0 not compared
# where it may differ), then the join's two codes in the last places of the message, where
# every other agreement holds padding: a joined rank meeting another operation differs there.
_DESCRIBED = 6 + _DIMS
_JOINED = agreement.WIDTH - 2  # 0 from an active rank, _JOIN_FLAG from a joined one
_COUNT = agreement.WIDTH - 1  # from a joined rank: rank - rounds it answered * size
_JOIN_FLAG = agreement.checksum("hvd.join() answering")


class Description:
    """What an operation is, in the fields that the ranks compare and joined ranks rebuild."""

    def __init__(self, kind: str, tensor: torch.Tensor, op: str = "sum", root: int = -1,
                 ignore_dim0: bool | None = None) -> None:
        self.kind, self.dtype, self.op, self.root = kind, tensor.dtype, op, root
        self.shape = tuple(tensor.shape)
        self.ignore_dim0 = kind in ("allgather", "alltoall") if ignore_dim0 is None else ignore_dim0

    def codes(self) -> list[int]:
        shape = list(self.shape)
        if self.ignore_dim0 and shape:
            shape[0] = -1  # first dimensions may differ
        if len(shape) > _DIMS:  # fold the tail: still equal exactly when the shapes agree
            shape = shape[: _DIMS - 1] + [int(torch.tensor(shape[_DIMS - 1:]).prod())]
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else 99
        described = [_HOROVOD, KINDS.index(self.kind), dtype, _OPS.index(self.op), self.root,
                     len(self.shape), *shape, *([-1] * (_DIMS - len(shape)))]
        return described + [NO_SAY] * (_JOINED - _DESCRIBED) + [0, NO_SAY]

    def __str__(self) -> str:
        root = f", root={self.root}" if self.kind in ("broadcast", "reduce") else ""
        op = f", op={self.op}" if self.kind in ("allreduce", "reducescatter", "reduce") else ""
        return f"{self.kind}(shape={list(self.shape)}, dtype={self.dtype}{op}{root})"


def _decode(codes: list[int]) -> tuple[str, torch.dtype, str, list[int]]:
    _who, kind, dtype, op, _root, ndim = codes[:6]
    return KINDS[kind], _DTYPES[dtype], _OPS[op], codes[6 : 6 + ndim]


class _State:
    starting: HorovodHandle | None = None  # the handle whose operation is being started


def _explain(ranks, described) -> str:
    lines = "\n".join(f"  rank {r}: {d}" for r, d in zip(ranks, described, strict=True))
    return (f"ranks called a collective with different arguments:\n{lines}\nMake every rank "
            "pass the same shape, dtype, op and root (a name= is matched by order here, not by "
            "name).")


_PREPARED: dict[tuple, agreement.Prepared] = {}
_MOST_PREPARED = 1024  # kinds of operation kept (a script makes a few dozen); past it, again


def _agree(mine: Description | None, answered: int = 0
           ) -> tuple[dict[int, tuple[int, int]], agreement.Posted | None]:
    """One negotiation: the agreement over the world, raised on every rank on a mismatch
    (`mine` None: a joined rank's, after `answered` rounds; only its message is returned)."""
    engine = runtime.state()
    if mine is None:
        # A say in the first code only (a Horovod operation: a rank in another one differs
        # there, and every rank raises), in the flag and in the answered rounds.
        codes = [_HOROVOD] + [NO_SAY] * (_JOINED - 1) + [
            _JOIN_FLAG, runtime.rank() - answered * runtime.size()]
    else:
        # An active rank's message is made once per kind of operation, and sent blocking
        # (`differing`): it names the same mismatches as a posted one, in fewer calls.
        key = (mine.kind, mine.dtype, mine.op, mine.root, mine.shape, mine.ignore_dim0)
        prepared = _PREPARED.get(key)
        if prepared is None:
            if len(_PREPARED) >= _MOST_PREPARED:
                _PREPARED.clear()
            prepared = _PREPARED[key] = agreement.prepare(mine.codes())
        differ = agreement.agree(mine.__str__, None, prepared=prepared,
                                 tolerated=(_JOINED, _COUNT), error=HorovodMismatchError,
                                 explain=_explain, engine=engine)
        return differ, None
    posted = agreement.post(codes, None, engine)
    said = "(joined: hvd.join() answers allreduces only)"
    differ = agreement.agree(said, None, codes=codes, posted=posted, tolerated=(_JOINED, _COUNT),
                             error=HorovodMismatchError, explain=_explain, engine=engine)
    return differ, posted


def negotiate(mine: Description) -> None:
    """Before an operation on the global set: agree on it, and refuse what joined ranks can't do."""
    if runtime.size() == 1:
        return
    handle = _State.starting
    begin = 0 if handle is None else time.time_ns() // 1000
    differ, _ = _agree(mine)
    if handle is not None:
        handle.kind = mine.kind
        timeline.span(mine.kind, handle.name, f"NEGOTIATE_{mine.kind.upper()}", begin,
                      time.time_ns() // 1000)
    if _JOINED in differ and mine.kind != "allreduce":
        raise RuntimeError(
            f"rank {runtime.rank()}: {mine} cannot run: a rank called hvd.join() and can only "
            "answer allreduce (as in Horovod); run it before join or on every rank")


def join_rounds(answer_allreduce: Callable[[torch.dtype, list[int], str], None]) -> int:
    """The joined rank's loop: answer negotiations until no rank is active; returns the last
    rank to join."""
    n = runtime.size()
    if n == 1:
        return 0
    answered = 0
    while True:
        try:
            _, posted = _agree(None, answered)
        except CollectiveMismatchError:
            continue  # the active ranks disagreed (or ran something else): they raise it
        finally:
            answered += 1
        highest = agreement.highest(posted)
        if highest[1] == NO_SAY:  # no active rank: every rank has joined
            return highest[_COUNT] % n
        kind, dtype, op, shape = _decode(highest)
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


pending: list[HorovodHandle] = []  # posted, not yet started (in posting order)
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
    pending.append(handle)
    if name is not None:
        _in_flight[name] = handle
    return handle


def start_pending() -> None:
    while pending:
        pending.pop(0)._begin()


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
    pending.clear()
    _in_flight.clear()
    _State.starting = None
