"""Collective fingerprints: which collective this is (its sequence number) and where it came from.

Debug mode (`td.init(debug=True)` / `TANDEM_DEBUG=1`) adds two numbers to the argument agreement
vector of every user-facing collective (`tandem.comm.checks`): the per-process sequence number
of the collective on its group, and a hash of the call site in the user's code. Ranks that
skipped a collective disagree on what collective #n is, and all raise one error that shows
each rank's call side by side:

    rank 0: #5 allreduce(shape=(3,), dtype=float32, op='mean') at train.py:31
    rank 1: #5 barrier() at train.py:35

Ranks that agree on everything but the line get a warning instead (once per pair of lines):
code that branches on the rank reaches one collective from two lines on purpose.

The call site is the innermost frame outside the tandem package (`file:line`, the file's base
name so that ranks started from different checkouts still agree). Walking the stack costs a
few microseconds, which is why it only happens in debug mode.

The watchdog reads `last(thread)` to name the user-level collective a rank is blocked in.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib
from dataclasses import dataclass
from types import FrameType

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Fingerprint:
    """One user-facing collective as debug mode sees it."""

    collective: str
    seq: int  # 1 for the first collective of this process on the group
    site: str  # "train.py:31"

    @property
    def site_code(self) -> int:
        return zlib.crc32(self.site.encode()) & 0x7FFFFFFF

    def __str__(self) -> str:
        return f"#{self.seq} {self.collective} at {self.site}"


def is_tandem_frame(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(PACKAGE_DIR)


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame at or above `frame` that is not tandem's own code."""
    while frame is not None and is_tandem_frame(frame):
        frame = frame.f_back
    return frame


def site_of(frame: FrameType | None) -> str:
    """`train.py:31` for a frame; `<unknown>` when there is none (a C thread)."""
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def call_site() -> str:
    """Where the user's code called into tandem, as `file:line`."""
    return site_of(user_frame(sys._getframe(1)))


def entry_point(frame: FrameType | None) -> str | None:
    """The tandem function the user's code called (`td.allreduce`), seen from a waiting frame.

    Walks outward from `frame` (innermost) and keeps the last tandem frame before user code.
    """
    entry = None
    while frame is not None and is_tandem_frame(frame):
        entry = frame
        frame = frame.f_back
    if entry is None:
        return None
    relative = entry.f_code.co_filename[len(PACKAGE_DIR):]
    module = relative.removesuffix(".py").replace(os.sep, ".")
    name = entry.f_code.co_name
    if module in ("comm.collectives", "comm.groups"):  # the public names of these functions
        return f"td.{name}"
    return f"tandem.{module}.{name}"


_CHECKS = (("agree", os.path.join("comm", "checks.py")),  # a collective's arguments
           ("agree_on", os.path.join("comm", "groups.py")))  # a group's creation


def in_argument_check(frame: FrameType | None) -> bool:
    """Whether a waiting frame is inside the argument check of a collective (`checks.agree`)
    or of a group's creation (`groups.agree_on`)."""
    while frame is not None and is_tandem_frame(frame):
        code = frame.f_code
        if any(code.co_name == name and code.co_filename.endswith(file) for name, file in _CHECKS):
            return True
        frame = frame.f_back
    return False


_sequence: dict[object, int] = {}
_last: dict[int, Fingerprint] = {}  # thread id -> the last fingerprint it made


def next_fingerprint(collective: str, stream: object) -> Fingerprint:
    """Count one more collective on `stream` (a group's identity) and say where it came from."""
    seq = _sequence.get(stream, 0) + 1
    _sequence[stream] = seq
    fingerprint = Fingerprint(collective, seq, call_site())
    _last[threading.get_ident()] = fingerprint
    return fingerprint


def last(thread_id: int) -> Fingerprint | None:
    """The last fingerprint thread `thread_id` made (debug mode only), for the watchdog."""
    return _last.get(thread_id)


def reset() -> None:
    """Forget every count: a new `init` starts from #1 on every rank."""
    _sequence.clear()
    _last.clear()
