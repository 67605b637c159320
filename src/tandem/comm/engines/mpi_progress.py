"""Completion and progress of non-blocking MPI operations.

MPICH moves a non-blocking collective forward only while some thread is inside an MPI call.
The data-parallel reducer posts its all-reduces during backward and waits at `step()`, so
without help nothing would move until the wait, and there would be no overlap. Three ways
were measured here (2 ranks, four 16 MB all-reduces posted, then 60 ms without MPI calls):

- nothing: 121 ms (all the communication happens at the wait);
- `MPIR_CVAR_ASYNC_PROGRESS=1`: overlaps, but MPICH's thread spins for the whole job and
  made unrelated compute 1.7x slower on this 2-core machine;
- a Python thread that tests the outstanding requests every 100 us while any exist and
  sleeps otherwise: 60 ms (full overlap), idle when nothing is in flight.

So `Progress` runs such a thread (see `Progress` for when it acts; `TANDEM_MPI_PROGRESS=none`
turns it off, and it is off when MPI was initialised below `MPI_THREAD_MULTIPLE`). The same
test with compute that keeps both cores busy (no spare core for the thread) took 92 ms with
the thread against 74 ms without: on a machine where the ranks use every core for CPU
compute, `none` can be faster.

A waiting caller does not hand off to the thread: it tests its own request in a loop (as
fast as `MPI_Wait` for small messages), yielding the CPU after the first 100 us so
oversubscribed ranks still run, and gives up at its deadline. Requests are only ever touched
under one lock, so the thread and the caller never complete the same request twice.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tandem.comm.engines.backend import Work

POLL_INTERVAL_S = 1e-4  # how often the progress thread tests requests nobody waits for
ARMED_INTERVAL_S = 1e-3  # how often it looks for such requests while the job is active
_IDLE_AFTER = 100  # looks in a row (100 ms) that find nothing outstanding: go idle
_IDLE_WAIT_S = 1.0  # the idle progress thread rechecks its stop flag this often
SPIN_S = 1e-4  # a waiting caller tests without yielding the CPU this long (as MPICH polls)
TESTS_PER_YIELD = 100  # after that, a caller driving its own request yields once per this many tests


class Progress:
    """The outstanding requests of one backend, and the thread that keeps them moving.

    The thread has three states. Idle: blocked on an event that the next `add` sets (one
    wake-up per burst of activity, not per operation). Armed: it looks every
    `ARMED_INTERVAL_S` for requests that are outstanding while nobody waits for them, and
    goes idle after 100 ms without any. Polling: it found some, and tests them every
    `POLL_INTERVAL_S` until they complete or a caller starts waiting (the caller then drives
    MPI itself). An operation that is waited for right away (most small ones) never involves
    the thread: waking it per operation cost 10x in latency on a busy 2-core machine.
    """

    def __init__(self, MPI: Any, thread: bool, default_timeout: float) -> None:
        self._MPI = MPI
        self.default_timeout = default_timeout  # for `wait()` without a timeout
        self.lock = threading.Lock()
        self.outstanding: set[MPIWork] = set()
        self.waiting = 0  # callers inside MPIWork.wait; the thread stands back meanwhile
        self._idle = True
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="tandem-mpi-progress",
                                            daemon=True)
            self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def add(self, work: MPIWork) -> None:
        outstanding = self.outstanding
        outstanding.add(work)  # atomic under the GIL; `poll` copies the set before testing
        if self._thread is None:
            if len(outstanding) > 1:
                self.poll()  # no thread: every new operation moves the older ones along
        elif self._idle:
            self._idle = False
            self._wake.set()

    def poll(self) -> None:
        """Test every outstanding request once (this is what makes MPI progress)."""
        with self.lock:
            for work in list(self.outstanding):
                work._test_locked()

    def _run(self) -> None:
        empty_looks = 0
        stopping = self._stopping
        while not stopping.is_set():
            if self._idle:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                if self.outstanding:  # an `add` that saw us armed just before we went idle
                    self._idle = False
                continue
            if stopping.wait(ARMED_INTERVAL_S):
                break
            if not self.outstanding:
                empty_looks += 1
                if empty_looks >= _IDLE_AFTER:
                    empty_looks = 0
                    self._idle = True
                    if self.outstanding:  # an `add` raced us and did not wake us: stay up
                        self._idle = False
                continue
            empty_looks = 0
            # Requests in flight that nobody waits for: keep them moving.
            while self.outstanding and not self.waiting and not stopping.is_set():
                self.poll()
                stopping.wait(POLL_INTERVAL_S)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


class Requests:
    """The requests of one operation posted in pieces, tested and cancelled as one request."""

    __slots__ = ("_Request", "_requests")

    def __init__(self, Request: Any, requests: list) -> None:
        self._Request, self._requests = Request, requests

    def Test(self) -> bool:
        return self._Request.Testall(self._requests)

    def Cancel(self) -> None:
        for request in self._requests:
            request.Cancel()

    def Wait(self) -> None:
        self._Request.Waitall(self._requests)


def completed_within(request: Any, seconds: float) -> bool:
    """Test `request` until it completes (True) or `seconds` pass (False): tight for `SPIN_S`,
    then yielding the CPU once every `TESTS_PER_YIELD` tests.

    For a request nobody else knows yet (not in `Progress.outstanding`), so no lock is taken.
    """
    test = request.Test
    if test():
        return True
    monotonic = time.monotonic
    start = monotonic()
    busy_until, until = start + SPIN_S, start + seconds
    while monotonic() < busy_until:
        if test():
            return True
    while monotonic() < until:
        # Yield only every so many tests, as MPICH's own blocking calls poll: a system call per
        # test is wasted when no other process wants this core, and with more ranks than cores
        # the others still get to run.
        for _ in range(TESTS_PER_YIELD):
            if test():
                return True
        os.sched_yield()
    return False


class MPIWork(Work):
    """One MPI request in flight, finished in the caller's thread.

    `after` (callables) runs once, in the thread that sees the completion through `wait` or
    `is_completed`: it copies stand-in buffers back into the caller's tensors. `refs` keeps
    every buffer MPI reads or writes alive until then, even if the caller drops the Work.
    """

    _mpi_done = False  # MPI completed the request (tested under the progress lock)
    _finished = False  # ... and `after` has run
    _error: BaseException | None = None
    _cancel = False

    def __init__(
        self,
        progress: Progress,
        request: Any,
        after: tuple[Callable[[], None], ...],
        refs: tuple,
        what: tuple,
        cancel_on_timeout: bool = False,
    ) -> None:
        self._progress = progress
        self._request = request
        self._after = after
        self._refs = refs
        # (describe, *args): describe(*args) gives (the operation, who it waits for). Put into
        # words only for an error, so the hot path pays nothing for it.
        self._what = what
        if cancel_on_timeout:
            self._cancel = True
        progress.add(self)

    def describe(self) -> tuple[str, str]:
        return self._what[0](*self._what[1:])

    def _test_locked(self) -> bool:
        """Test the request; the caller holds the progress lock."""
        if not self._mpi_done:
            try:
                done = self._request.Test()
            except self._progress._MPI.Exception as error:
                self._error = error
                done = True
            if done:
                self._mpi_done = True
                self._progress.outstanding.discard(self)
        return self._mpi_done

    def _test(self) -> bool:
        with self._progress.lock:
            return self._test_locked()

    def _finish(self) -> None:
        self._finished = True
        after, self._after, self._refs = self._after, (), ()
        for step in after:
            step()
        if self._error is not None:
            raise RuntimeError(f"MPI {self.describe()[0]} failed: {self._error}") from self._error

    def is_completed(self) -> bool:
        if self._finished:
            return True
        if not self._test():
            return False
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._finished:
            return
        if not self._test():
            self._spin(self._progress.default_timeout if timeout is None else timeout)
        self._finish()

    def _spin(self, timeout: float) -> None:
        start = time.monotonic()
        busy_until, deadline = start + SPIN_S, start + timeout
        progress = self._progress
        monotonic = time.monotonic
        with progress.lock:
            progress.waiting += 1
            # First a tight loop under the lock: the fewer Python steps between two tests,
            # the more often MPI moves the data (medium messages finish here).
            test = self._test_locked
            while not test() and monotonic() < busy_until:
                pass
        try:
            while not self._test():
                os.sched_yield()  # let other ranks on these cores run (GIL released)
                if monotonic() > deadline:
                    self._timed_out(timeout)
        finally:
            with progress.lock:
                progress.waiting -= 1

    def _timed_out(self, timeout: float) -> None:
        what, waiting_for = self.describe()
        message = f"MPI {what} did not complete within {timeout:g} s: {waiting_for}"
        if self._cancel:
            # An unmatched receive can be withdrawn, leaving MPI clean for what follows.
            with self._progress.lock:
                self._request.Cancel()
                self._request.Wait()
                self._mpi_done = True
                self._progress.outstanding.discard(self)
            self._finished = True
            self._after, self._refs = (), ()  # the tensor's contents are unspecified
            raise TimeoutError(f"{message}. The receive was cancelled.")
        raise TimeoutError(message)
