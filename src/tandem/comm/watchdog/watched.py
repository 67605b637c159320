"""The watchdog every operation passes through: the wrapper, its counters and its errors.

`td.init` wraps the engine it created (Gloo, NCCL, MPI; every world larger than one) in a
`WatchedBackend`, which gives each operation's `Work` to a `WatchedWork`: issuing an operation
counts it on its stream (see `waitgraph`) and keeps a small tuple; waiting puts that tuple in
this rank's table of waits for the duration of the wait, and hands a failure to the watchdog,
which explains it. That is all the hot path pays, the user's collectives and tandem's own hot
paths alike: about a microsecond of Python per operation, no communication, no lock (see
`benchmarks/faults.py --overhead`). Everything else (the thread that reads these tables, the
questions to the other ranks, the reports) is in `monitor`.
"""

from __future__ import annotations

import threading
import time

from tandem.comm.engines.backend import Backend, Work

# The hot path builds plain tuples (a few hundred nanoseconds cheaper than objects); reports
# turn them into dicts. An operation: (kind, stream, index, members, tensor, peer, tag), where
# `members` is a group (None: the world) or the (src, dst) pair of a message, and `tensor` is
# only read for its shape and dtype. A wait: (operation, start, limit, serial).
_KIND, _STREAM, _INDEX, _MEMBERS, _TENSOR, _PEER, _TAG = range(7)
WAIT_OP, WAIT_START, WAIT_LIMIT, WAIT_SERIAL = range(4)
_monotonic = time.monotonic
_get_ident = threading.get_ident


class WatchdogTimeout(TimeoutError):
    """A wait passed the timeout; the message says who arrived and holds every rank's stack.

    `silent`: the ranks of the wait that did not answer the watchdog's question at all (a
    stopped or hung process, not one computing): the ones to blame, and, in an elastic job,
    the ones the launcher drops (`tandem.elastic.run`).
    """

    def __init__(self, message: str = "", silent: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.silent = tuple(silent)


class PeerUnreachableError(RuntimeError):
    """An operation failed because a peer died, left, or cannot be reached; names the peer."""


def op_dict(op: tuple, size: int) -> dict:
    members = op[_MEMBERS]
    if members is None:
        members = range(size)
    elif not isinstance(members, tuple):
        members = members.ranks  # a group
    tensor = op[_TENSOR]
    detail = "" if tensor is None else (
        f"{str(tensor.dtype).replace('torch.', '')}[{','.join(map(str, tensor.shape))}]")
    return {"kind": op[_KIND], "stream": op[_STREAM], "index": op[_INDEX],
            "members": list(members), "detail": detail, "peer": op[_PEER], "tag": op[_TAG]}


class Ledger:
    """One rank's counters: what it issued on each stream, and the waits it is in now.

    The hot path's half of the watchdog. `monitor.Watchdog` extends it with the thread that
    reads these tables and with `failed`, which turns a failed wait into a report.
    """

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._issued: dict[str, int] = {}
        self._labels: dict[int, str] = {}
        self._waiting: dict[int, tuple] = {}  # thread id -> the wait it is in
        self._serial = 0

    def stream(self, group) -> str:
        if group is None:
            return "world"
        return self._labels.get(id(group.handle)) or f"[{','.join(map(str, group.ranks))}]"

    def issue(self, work: Work, kind: str, group, tensor=None) -> WatchedWork:
        # `count`, written out: every operation passes here (a call per bucket saved).
        stream = "world" if group is None else self.stream(group)
        issued = self._issued
        index = issued[stream] = issued.get(stream, 0) + 1
        return WatchedWork(work, (kind, stream, index, group, tensor, None, None), self)

    def count(self, group) -> tuple[str, int]:
        """Count one operation on `group`'s stream: (the stream, its index there). Called alone
        for an operation that completed before `issue` could wrap it (`allreduce_now`)."""
        stream = "world" if group is None else self.stream(group)
        issued = self._issued
        index = issued[stream] = issued.get(stream, 0) + 1
        return stream, index

    def issue_p2p(self, work: Work, kind: str, group, tensor, peer: int, tag: int) -> WatchedWork:
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        stream = f"{self.stream(group)} {src}->{dst} tag {tag}"
        index = self._issued[stream] = self._issued.get(stream, 0) + 1
        return WatchedWork(work, (kind, stream, index, (src, dst), tensor, peer, tag), self)

    def name_group(self, handle: object, ranks) -> None:
        label = f"[{','.join(map(str, ranks))}]"
        taken = set(self._labels.values())
        suffix = 2
        unique = label
        while unique in taken:
            unique, suffix = f"{label}#{suffix}", suffix + 1
        self._labels[id(handle)] = unique

    def failed(self, wait: tuple, error: BaseException) -> None:
        """Called by a failing `wait`: raise a better error, or return to re-raise `error`."""

    def stop(self) -> None:
        """Leave the job; the monitor tells the other ranks."""


class WatchedWork(Work):
    """A `Work` whose wait the watchdog knows about; failures come back explained."""

    __slots__ = ("_work", "_op", "_dog")

    def __init__(self, work: Work, op: tuple, dog: Ledger) -> None:
        self._work, self._op, self._dog = work, op, dog

    def wait(self, timeout: float | None = None) -> None:
        dog = self._dog
        dog._serial += 1
        wait = (self._op, _monotonic(), dog.timeout if timeout is None else timeout, dog._serial)
        tid = _get_ident()
        waiting = dog._waiting
        waiting[tid] = wait
        try:
            self._work.wait(timeout)
        except Exception as error:
            dog.failed(wait, error)
            raise
        finally:
            waiting.pop(tid, None)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class WatchedBackend(Backend):
    """The engine `td.init` chose, with every operation counted and every wait watched."""

    def __init__(self, inner: Backend, dog: Ledger) -> None:
        self._inner, self.watchdog = inner, dog
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        # Asked before every message (on_wire): the engine's own answer, with no call between.
        self.supports_device = inner.supports_device

    def __getattr__(self, name: str):
        return getattr(self._inner, name)  # engine-specific extras (device, communicator...)

    @property
    def inner(self) -> Backend:
        return self._inner

    def allreduce(self, tensor, op, group):
        return self.watchdog.issue(self._inner.allreduce(tensor, op, group), "allreduce", group,
                                   tensor)

    def allreduce_now(self, tensor, op, group):
        # Finished on the spot: nothing was waited for, so only the count moves.
        work = self._inner.allreduce_now(tensor, op, group)
        if work is None:
            if group is None:  # `count`, written out for the world (every small td.allreduce)
                issued = self.watchdog._issued
                issued["world"] = issued.get("world", 0) + 1
            else:
                self.watchdog.count(group)
            return None
        return self.watchdog.issue(work, "allreduce", group, tensor)

    def broadcast(self, tensor, root, group):
        return self.watchdog.issue(self._inner.broadcast(tensor, root, group), "broadcast",
                                   group, tensor)

    def broadcast_now(self, tensor, root, group):
        work = self._inner.broadcast_now(tensor, root, group)
        if work is None:  # finished on the spot, as allreduce_now's
            self.watchdog.count(group)
            return None
        return self.watchdog.issue(work, "broadcast", group, tensor)

    def allgather_into(self, output, input, group):
        return self.watchdog.issue(self._inner.allgather_into(output, input, group),
                                   "allgather", group, input)

    def reduce(self, tensor, root, op, group):
        return self.watchdog.issue(self._inner.reduce(tensor, root, op, group), "reduce", group,
                                   tensor)

    def reducescatter_into(self, output, input, op, group):
        return self.watchdog.issue(self._inner.reducescatter_into(output, input, op, group),
                                   "reducescatter", group, input)

    def alltoall_into(self, output, input, output_splits, input_splits, group):
        work = self._inner.alltoall_into(output, input, output_splits, input_splits, group)
        return self.watchdog.issue(work, "alltoall", group, input)

    def gather(self, output, input, root, group):
        return self.watchdog.issue(self._inner.gather(output, input, root, group), "gather",
                                   group, input)

    def scatter(self, output, input, root, group):
        return self.watchdog.issue(self._inner.scatter(output, input, root, group), "scatter",
                                   group, output)

    def send(self, tensor, dst, tag, group):
        return self.watchdog.issue_p2p(self._inner.send(tensor, dst, tag, group), "send", group,
                                       tensor, dst, tag)

    def recv(self, tensor, src, tag, group):
        return self.watchdog.issue_p2p(self._inner.recv(tensor, src, tag, group), "recv", group,
                                       tensor, src, tag)

    def barrier(self, group):
        return self.watchdog.issue(self._inner.barrier(group), "barrier", group)

    def new_group(self, ranks):
        handle = self._inner.new_group(ranks)
        self.watchdog.name_group(handle, ranks)
        return handle

    def supports_device(self, device) -> bool:
        return self._inner.supports_device(device)

    @property
    def staging_device(self):
        return self._inner.staging_device

    def shutdown(self) -> None:
        # The engine must be torn down while the interpreter is alive, whatever the watchdog
        # does: Gloo threads left to interpreter teardown abort the process (std::terminate).
        try:
            self.watchdog.stop()
        finally:
            self._inner.shutdown()
