"""`hvd.start_timeline` / `hvd.stop_timeline`: Horovod's run-time timeline of its operations.

A Chrome trace (open it in chrome://tracing or Perfetto) in Horovod's format: one process per
operation name (`allreduce.grads`), a `NEGOTIATE_<OP>` span for the agreement round that starts
it and an `<OP>` span for the operation, `CYCLE_START` marks with `mark_cycles=True`, and the
start time since the epoch in the metadata. The file is written when the timeline stops (or
another starts). For compute, data and every gradient bucket, use tandem's own timeline
(`tandem run --timeline FILE`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class _Recording:
    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.path, self.mark_cycles = path, mark_cycles
        self.start_us = time.time_ns() // 1000
        self.events: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}

    def pid(self, process: str) -> int:
        if process not in self.pids:
            self.pids[process] = len(self.pids) + 1
            self.events.append({"name": "process_name", "ph": "M", "pid": self.pids[process],
                                "args": {"name": process}})
        return self.pids[process]

    def write(self) -> None:
        meta = {"name": "timeline_metadata", "ph": "M", "pid": 0,
                "args": {"start_time_since_epoch_in_micros": self.start_us}}
        with open(self.path, "w") as out:
            json.dump([meta, *self.events], out)
            out.write("\n")


_current: _Recording | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's Horovod operations to `file_path` until `stop_timeline()`."""
    global _current
    if _current is not None and os.path.abspath(_current.path) == os.path.abspath(file_path):
        _current.mark_cycles = mark_cycles
        return
    stop_timeline()
    _current = _Recording(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the file."""
    global _current
    if _current is not None:
        recording, _current = _current, None
        recording.write()


def span(kind: str, name: str | None, phase: str, begin_us: int, end_us: int) -> None:
    """Record one span of operation `kind` named `name` (cheap no-op when not recording)."""
    recording = _current
    if recording is None:
        return
    pid = recording.pid(f"{kind}.{name or 'noname'}")
    start = begin_us - recording.start_us
    if recording.mark_cycles:
        recording.events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": pid,
                                 "ts": start})
    recording.events.append({"name": phase, "ph": "X", "pid": pid, "tid": 0, "ts": start,
                             "dur": max(0, end_us - begin_us)})


def recording() -> bool:
    return _current is not None
