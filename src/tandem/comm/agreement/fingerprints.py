"""Collective fingerprints: which collective this is (its sequence number) and where it came from.

Debug mode (`td.init(debug=True)` / `TANDEM_DEBUG=1`) adds two numbers to the argument agreement
vector of every user-facing collective (`tandem.comm.agreement.checks`): the per-process sequence number
of the collective on its group, and a hash of the call site in the user's code. Ranks that
skipped a collective disagree on what collective #n is, and all raise one error that shows
each rank's call side by side:

    rank 0: #5 allreduce(shape=(3,), dtype=float32, op='mean') at train.py:31
    rank 1: #5 barrier() at train.py:35

Ranks that agree on everything but the line get a warning instead (once per pair of lines):
code that branches on the rank reaches one collective from two lines on purpose.

The call site is the innermost frame outside the tandem and torch packages (`file:line`, the
file's base name so that ranks started from different checkouts still agree): for
`dist.all_reduce(t)` on backend "tandem" that is the user's line, not torch's. The argument
check of every mode carries a code of it (`site_key`, `site_code`): a walk of a few frames,
each library frame known by its file name after the first time, and one dictionary look-up
per line (well under a microsecond); `Site` is what a rank tells the others on a mismatch.

The watchdog reads `last(thread)` to name the user-level collective a rank is blocked in.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import zlib
from dataclasses import dataclass
from types import FrameType

import torch

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_LIBRARIES = (PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


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


# file name -> whether it is tandem's or torch's (a str keeps its hash: a look-up is ~40 ns,
# where hashing a code object costs ~200 ns and a prefix test ~180 ns)
_library: dict[str, bool] = {}


def _is_library(filename: str) -> bool:
    found = _library.get(filename)
    if found is None:
        found = _library[filename] = filename.startswith(_LIBRARIES)
    return found


def site_key() -> tuple[str, int]:
    """`(file, line)` of the innermost frame outside tandem and torch, from the caller's caller
    outward: the user's line of a td.* or dist.* call. The per-call part of the default
    check: a few frames, each a dictionary look-up."""
    frame = sys._getframe(2)
    library = _library  # `_is_library`, written out: a call per frame is most of the walk
    while frame is not None:
        filename = frame.f_code.co_filename
        found = library.get(filename)
        if found is None:
            found = _is_library(filename)
        if not found:
            break
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0)
    # f_lineno scans the code's line table; the instruction offset is an attribute
    code = frame.f_code
    found = _lines.get((id(code), frame.f_lasti))
    if found is None or found[0] is not code:  # (the code kept alive: its id stays its own)
        if len(_lines) >= _MOST_LINES:
            _lines.clear()
        found = _lines[(id(code), frame.f_lasti)] = (code, (code.co_filename, frame.f_lineno))
    return found[1]


_lines: dict[tuple[int, int], tuple] = {}  # (id(code), instruction) -> (code, site_key)
_MOST_LINES = 4096


_codes: dict[tuple[str, int], int] = {}


def site_code(key: tuple[str, int]) -> int:
    """A 31-bit code of a `site_key` (its base name and line: the same on every rank)."""
    found = _codes.get(key)
    if found is None:
        found = _codes[key] = zlib.crc32(site_text(key).encode()) & 0x7FFFFFFF
    return found


def site_text(key: tuple[str, int]) -> str:
    """`file:line` of a `site_key`, as messages print it."""
    return f"{os.path.basename(key[0])}:{key[1]}"


@dataclass(frozen=True)
class Site:
    """A rank's call site as the others see it on a mismatch: `file:line` and the checksum of
    its file's text (None when unreadable), so that ranks judge the lines only when they all
    read the same file."""

    text: str  # "train.py:31"
    name: str  # "train.py"
    line: int
    source: int | None

    @classmethod
    def of(cls, key: tuple[str, int]) -> Site:
        return cls(site_text(key), os.path.basename(key[0]), key[1], _source_code(key[0]))


def _source_code(path: str) -> int | None:
    lines = linecache.getlines(path)
    return zlib.crc32("".join(lines).encode()) & 0x7FFFFFFF if lines else None


def source_of(site: Site, path: str) -> str | None:
    """The text of `site`'s file as read here from `path`, if it is the one `site` names."""
    text = "".join(linecache.getlines(path))
    if not text or zlib.crc32(text.encode()) & 0x7FFFFFFF != site.source:
        return None
    return text


def call_site() -> str:
    """Where the user's code called into tandem (or into torch.distributed on backend
    "tandem"), as `file:line`."""
    return site_text(site_key())


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
    if module in ("comm.collectives.user", "comm.groups"):  # the public names of these functions
        return f"td.{name}"
    return f"tandem.{module}.{name}"


_CHECKS = (("agree", os.path.join("comm", "agreement", "checks.py")),  # a collective's arguments
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


def next_fingerprint(collective: str, stream: object,
                     site: tuple[str, int] | None = None) -> Fingerprint:
    """Count one more collective on `stream` (a group's identity) and say where it came from
    (`site`: its `site_key`, when the caller has it)."""
    seq = _sequence.get(stream, 0) + 1
    _sequence[stream] = seq
    fingerprint = Fingerprint(collective, seq, call_site() if site is None else site_text(site))
    _last[threading.get_ident()] = fingerprint
    return fingerprint


def last(thread_id: int) -> Fingerprint | None:
    """The last fingerprint thread `thread_id` made (debug mode only), for the watchdog."""
    return _last.get(thread_id)


# (group, pair of line codes) the argument check judged and let run (`checks`): every member
# of the group took part in judging it, so every member skips the exchange next time alike.
judged: set[tuple] = set()


def reset() -> None:
    """Forget every count and judged pair: a new `init` starts from #1 on every rank."""
    _sequence.clear()
    _last.clear()
    judged.clear()
