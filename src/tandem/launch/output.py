"""Rank output: every line a rank prints reaches our stdout/stderr as `[rank] line`.

One reader thread per pipe copies whole lines, each written with a single locked write so
lines of different ranks never interleave mid-line. The last lines of each rank are kept for
the failure summary. Bytes pass through untouched (no decoding on the way to the terminal).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import BinaryIO, TextIO

TAIL_LINES = 20
MAX_LINE_BYTES = 1 << 16  # a longer line is split into several prefixed pieces

# Signals the agent handles itself; its helper threads block them so the kernel delivers
# them to the main thread, which is the one waiting for events.
AGENT_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def block_agent_signals() -> None:
    """Call first thing in a helper thread: leave SIGINT/SIGTERM/SIGHUP to the main thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_SIGNALS)


@contextmanager
def signals_blocked():
    """Threads created inside (the store's, a listener's) leave our signals to this thread."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Sink:
    """A locked, line-at-a-time writer over a text stream (its binary buffer when it has one)."""

    def __init__(self, stream: TextIO, lock: threading.Lock) -> None:
        self._text = stream
        self._binary: BinaryIO | None = getattr(stream, "buffer", None)
        self._lock = lock

    def write_line(self, line: bytes) -> None:
        with self._lock:
            try:
                if self._binary is not None:
                    self._binary.write(line)
                    self._binary.flush()
                else:
                    self._text.write(line.decode("utf-8", "replace"))
                    self._text.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (closed pipe): keep draining the rank anyway


class RankOutput:
    """Copies each rank's stdout and stderr to ours, prefixed, and remembers their last lines."""

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        tail_lines: int = TAIL_LINES,
    ) -> None:
        lock = threading.Lock()  # one lock for both streams: a terminal shows them together
        self._stdout = _Sink(stdout or sys.stdout, lock)
        self._stderr = _Sink(stderr or sys.stderr, lock)
        self._tail_lines = tail_lines
        self._tails: dict[int, deque[str]] = {}
        self._tails_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def attach(self, rank: int, stdout: BinaryIO, stderr: BinaryIO) -> None:
        """Start copying the two pipes of `rank` (until they reach end of file)."""
        self._tails[rank] = deque(maxlen=self._tail_lines)
        for pipe, sink, name in ((stdout, self._stdout, "out"), (stderr, self._stderr, "err")):
            thread = threading.Thread(
                target=self._copy, args=(rank, pipe, sink),
                name=f"tandem-rank{rank}-std{name}", daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def _copy(self, rank: int, pipe: BinaryIO, sink: _Sink) -> None:
        block_agent_signals()
        prefix = f"[{rank}] ".encode()
        with pipe:
            for line in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                sink.write_line(prefix + line)
                text = line.decode("utf-8", "replace").rstrip("\r\n")
                with self._tails_lock:
                    self._tails[rank].append(text)

    def message(self, text: str) -> None:
        """The agent's own words on stderr, never in the middle of a rank's line."""
        self._stderr.write_line(text.rstrip("\n").encode("utf-8", "replace") + b"\n")

    def tail(self, rank: int) -> list[str]:
        """The last lines `rank` printed (stdout and stderr, in the order they arrived)."""
        with self._tails_lock:
            return list(self._tails.get(rank, ()))

    def join(self, timeout: float) -> bool:
        """Wait until every pipe is drained, `timeout` seconds at most; True when all were.

        A pipe stays open while any process holds it, so a rank's leftover child could keep
        it open forever; the deadline keeps the agent from waiting on it.
        """
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
