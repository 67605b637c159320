"""Rank output: every line a rank prints reaches our stdout/stderr as `[rank] line`.

One reader thread per pipe copies whole lines, each written with a single locked write so
lines of different ranks never interleave mid-line. The last lines of each rank are kept for
the failure summary. Bytes pass through untouched (no decoding on the way to the terminal).

Progress bars: when our stderr is a terminal, rank 0 is told so (`TANDEM_TERMINAL=1`, see
`terminal_rank`) and its carriage returns pass through: its bar is drawn in place as the
terminal's last line, `[0] epoch 1: 40%|###`, other ranks' lines are written above it, and it
stays there until rank 0 ends the line. Into a file or a pipe nothing changes: rank 0's bar
is written as plain lines (`tandem.metrics.average.progress` sees no terminal), so logs stay greppable.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from contextlib import contextmanager
from typing import BinaryIO, TextIO

TAIL_LINES = 20
MAX_LINE_BYTES = 1 << 16  # a longer line is split into several prefixed pieces

# Signals the agent handles itself; its helper threads block them so the kernel delivers
# them to the main thread, which is the one waiting for events.
# SIGUSR1/SIGUSR2 too: a scheduler's warning before a kill (`--signal=B:USR1@120`), passed on.
AGENT_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                           signal.SIGUSR2})


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


class _Screen:
    """What both sinks share: the lock, and rank 0's bar while one is drawn (and on which sink)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bar = b""
        self.bar_sink: _Sink | None = None


class _Sink:
    """A locked, line-at-a-time writer over a text stream (its binary buffer when it has one)."""

    def __init__(self, stream: TextIO, screen: _Screen) -> None:
        self._text = stream
        self._binary: BinaryIO | None = getattr(stream, "buffer", None)
        self._screen = screen
        self.terminal = bool(getattr(stream, "isatty", lambda: False)())

    def _raw(self, data: bytes) -> None:
        try:
            if self._binary is not None:
                self._binary.write(data)
                self._binary.flush()
            else:
                self._text.write(data.decode("utf-8", "replace"))
                self._text.flush()
        except (OSError, ValueError):
            pass  # our own output is gone (closed pipe): keep draining the rank anyway

    def write_line(self, line: bytes) -> None:
        """Write one whole line; a bar on the screen is cleared first and redrawn below it."""
        screen = self._screen
        with screen.lock:
            bar, bar_sink = screen.bar, screen.bar_sink
            if bar and bar_sink is not None:
                bar_sink._raw(_CLEAR)
            self._raw(line)
            if bar and bar_sink is not None:
                bar_sink._raw(bar)

    def draw(self, bar: bytes) -> None:
        """Show `bar` in place of the previous one (nothing: clear it)."""
        screen = self._screen
        with screen.lock:
            if screen.bar and screen.bar_sink is not None:
                screen.bar_sink._raw(_CLEAR)
            screen.bar, screen.bar_sink = (bar, self) if bar else (b"", None)
            if bar:
                self._raw(bar)

    def end_bar(self, line: bytes) -> None:
        """The barred line ends as `line`: it replaces the bar and stays."""
        screen = self._screen
        with screen.lock:
            if screen.bar and screen.bar_sink is not None:
                screen.bar_sink._raw(_CLEAR)
            screen.bar, screen.bar_sink = b"", None
            self._raw(line)


_CLEAR = b"\r\x1b[K"  # back to the start of the line, erase it
# A rank's watchdog naming a peer that did not answer at all (`comm.watchdog`'s report): noted
# as the line passes, since the report (a stack per rank) can be longer than the kept tail.
_SILENT_WORDS = b"did not answer the watchdog"
_SILENT = re.compile(rb"\brank (\d+): did not answer the watchdog\b")


class RankOutput:
    """Copies each rank's stdout and stderr to ours, prefixed, and remembers their last lines."""

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        tail_lines: int = TAIL_LINES,
        echo: bool = True,
    ) -> None:
        screen = _Screen()  # one lock for both streams: a terminal shows them together
        self._stdout = _Sink(stdout or sys.stdout, screen)
        self._stderr = _Sink(stderr or sys.stderr, screen)
        self._tail_lines = tail_lines
        self._echo = echo  # False: only remembered (a test world's ranks, read back on failure)
        self._tails: dict[int, deque[str]] = {}
        self._named_silent: dict[int, set[int]] = {}  # rank -> peers its watchdog named silent
        self._tails_lock = threading.Lock()
        self._threads: dict[int, list[threading.Thread]] = {}
        self.spoke: set[int] = set()  # ranks that printed a line on stdout: past their imports

    def terminal_rank(self, rank: int) -> bool:
        """Whether `rank`'s bars may redraw in place: rank 0, when our stderr is a terminal.

        The launcher then sets `TANDEM_TERMINAL=1` for it, so that `progress` draws with
        carriage returns although its own stderr is our pipe.
        """
        return rank == 0 and self._stderr.terminal

    def attach(self, rank: int, stdout: BinaryIO, stderr: BinaryIO) -> None:
        """Start copying the two pipes of `rank` (until they reach end of file)."""
        self._tails[rank] = deque(maxlen=self._tail_lines)
        self._named_silent[rank] = set()
        for pipe, sink, name in ((stdout, self._stdout, "out"), (stderr, self._stderr, "err")):
            live = self._echo and self.terminal_rank(rank) and sink.terminal
            copy = self._copy_live if live else self._copy
            thread = threading.Thread(
                target=copy, args=(rank, pipe, sink),
                name=f"tandem-rank{rank}-std{name}", daemon=True,
            )
            thread.start()
            self._threads.setdefault(rank, []).append(thread)

    def named_silent(self) -> set[int]:
        """The ranks that some rank's watchdog named as not answering at all, since their
        pipes were attached (a stopped, hung or deadlocked process)."""
        with self._tails_lock:
            return set().union(*self._named_silent.values())

    def _remember(self, rank: int, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        named = {int(found) for found in _SILENT.findall(line)} if _SILENT_WORDS in line else ()
        with self._tails_lock:
            self._tails[rank].append(text)
            self._named_silent[rank].update(named)

    def _copy(self, rank: int, pipe: BinaryIO, sink: _Sink) -> None:
        block_agent_signals()
        prefix = f"[{rank}] ".encode()
        with pipe:
            for line in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if self._echo:
                    sink.write_line(prefix + line)
                self._remember(rank, line)
                if sink is self._stdout:
                    self.spoke.add(rank)

    def _copy_live(self, rank: int, pipe: BinaryIO, sink: _Sink) -> None:
        """Like `_copy`, but text after a carriage return is drawn at once, in place."""
        block_agent_signals()
        prefix = f"[{rank}] ".encode()
        pending, drawn = b"", False  # the unfinished line; whether it is on the screen as a bar
        read = getattr(pipe, "read1", pipe.read)
        with pipe:
            for chunk in iter(lambda: read(MAX_LINE_BYTES), b""):
                if sink is self._stdout:
                    self.spoke.add(rank)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    shown = _last_segment(line)
                    if shown.strip():
                        (sink.end_bar if drawn else sink.write_line)(prefix + shown + b"\n")
                        self._remember(rank, shown)
                    elif drawn:
                        sink.draw(b"")
                    drawn = False
                if b"\r" in pending or drawn:
                    pending = _last_segment(pending)
                    sink.draw(prefix + pending if pending.strip() else b"")
                    drawn = True
                if len(pending) > MAX_LINE_BYTES:  # a line that never ends: write it in pieces
                    (sink.end_bar if drawn else sink.write_line)(prefix + pending + b"\n")
                    pending, drawn = b"", False
            if pending.strip():
                (sink.end_bar if drawn else sink.write_line)(prefix + pending + b"\n")
                self._remember(rank, pending)
            elif drawn:
                sink.draw(b"")

    def message(self, text: str) -> None:
        """The agent's own words on stderr, never in the middle of a rank's line."""
        self._stderr.write_line(text.rstrip("\n").encode("utf-8", "replace") + b"\n")

    def tail(self, rank: int) -> list[str]:
        """The last lines `rank` printed (stdout and stderr, in the order they arrived)."""
        with self._tails_lock:
            return list(self._tails.get(rank, ()))

    def join(self, timeout: float, ranks: Iterable[int] | None = None) -> bool:
        """Wait until every pipe (of `ranks`, default all) is drained, `timeout` seconds at
        most; True when all were.

        A pipe stays open while any process holds it, so a rank's leftover child could keep
        it open forever; the deadline keeps the agent from waiting on it.
        """
        deadline = time.monotonic() + timeout
        threads = [thread for rank in (self._threads if ranks is None else ranks)
                   for thread in self._threads.get(rank, ())]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


def _last_segment(text: bytes) -> bytes:
    """What a terminal would show of `text`: the part after its last non-empty carriage return."""
    segments = [part for part in text.split(b"\r") if part]
    return segments[-1] if segments else b""
