"""The timeline: a Chrome / Perfetto trace of compute and communication, one track per rank.

    TANDEM_TIMELINE=trace.json tandem run -np 2 train.py
    # open trace.json in https://ui.perfetto.dev or chrome://tracing

Each rank is one process in the trace (pid = rank) with a few threads: `compute` (spans
`forward`, `backward`, a `wait` for each bucket's reduction, `optimizer step`), `data`
(waiting for batches) and one `bucket <i>` row per gradient bucket (`allreduce`: from its
launch during backward to the moment the reducer saw it complete). Forward is inferred: from
the end of the previous step (or of the batch fetch after it) to the first gradient, as the
data-parallel optimizer never sees the model.

Events are buffered in a ring of `TANDEM_TIMELINE_EVENTS` (default 200,000) per rank, so
memory stays bounded however long the job runs: the oldest events are dropped and the trace
says how many.

At exit every rank writes its part (`trace.json.parts/<job>.rank<r>.json`); the last rank to
finish merges all parts into `trace.json` and removes them. When ranks do not share a file
system, merge the parts by hand: `python -m tandem.diagnostics.timeline trace.json PART...`.

Cost when off: instrumented code checks the module-level boolean `ENABLED` and does nothing
else (`if timeline.ENABLED: ...`, ~4 ns); `span()` returns a shared no-op context manager
(~0.2 us; `python benchmarks/scaling.py` measures both).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tandem.job import settings

ENABLED = False  # hot paths test this and nothing else

DEFAULT_CAPACITY = 200_000
COMPUTE, DATA, BUCKET0 = 0, 1, 100  # thread ids: bucket i is BUCKET0 + i
_THREAD_NAMES = {COMPUTE: "compute", DATA: "data"}

_events: list[tuple | None] = []
_count = 0  # events recorded (may exceed the capacity: the ring keeps the last ones)
_capacity = 0
_path: str | None = None
_rank, _size, _job = 0, 1, "job"
_epoch_offset_ns = 0  # time.time_ns() - time.perf_counter_ns(), so ranks share a clock
_NULL = contextlib.nullcontext()


def now() -> int:
    """The timeline's clock (ns); pass its readings to `complete`."""
    return time.perf_counter_ns()


def complete(name: str, start_ns: int, end_ns: int, tid: int = COMPUTE,
             args: dict[str, Any] | None = None) -> None:
    """Record one finished span. Call only when `ENABLED` (the caller checks, to stay free)."""
    global _count
    _events[_count % _capacity] = (name, start_ns, end_ns, tid, args)
    _count += 1


@contextlib.contextmanager
def _span(name: str, tid: int, args: dict[str, Any] | None) -> Iterator[None]:
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        complete(name, start, time.perf_counter_ns(), tid, args)


def span(name: str, tid: int = COMPUTE, args: dict[str, Any] | None = None):
    """`with timeline.span("forward"):` records the block; a shared no-op when disabled."""
    if not ENABLED:
        return _NULL
    return _span(name, tid, args)


# --- marks from the optimizer and the loader --------------------------------------------------

# The data-parallel optimizer never sees the model, so forward and backward are inferred from
# marks: forward runs from the end of the previous step (or of the batch fetch that followed
# it) to the first gradient; backward from there to the entry of step(). Call these only when
# ENABLED.
_forward_from = 0
_backward_from = 0


def batch_fetched(start_ns: int, end_ns: int) -> None:
    """The loader waited from `start_ns` to `end_ns` for a batch."""
    global _forward_from
    complete("data", start_ns, end_ns, DATA)
    _forward_from = end_ns


def backward_started() -> None:
    """The first gradient of a step is ready (the reducer's first hook of the round)."""
    global _backward_from
    now_ns = time.perf_counter_ns()
    if _forward_from:
        complete("forward", _forward_from, now_ns)
    _backward_from = now_ns


def step_started() -> None:
    """The optimizer's step() was entered: backward is over."""
    global _backward_from
    now_ns = time.perf_counter_ns()
    if _backward_from:
        complete("backward", _backward_from, now_ns)
    elif _forward_from:  # no gradient hooks (a world of one): one span for both
        complete("forward+backward", _forward_from, now_ns)
    _backward_from = 0


def step_finished() -> None:
    """The step is over; the next forward starts now (or after the next batch fetch)."""
    global _forward_from
    _forward_from = time.perf_counter_ns()


# --- switching on ----------------------------------------------------------------------------


def configure() -> bool:
    """Start recording if `TANDEM_TIMELINE` names a file (once; later calls are free).

    The data-parallel optimizer and reducer call this when they are built (after `td.init`,
    so the rank is known); scripts never need to.
    """
    if ENABLED or _path is not None:
        return ENABLED
    told = settings.current()
    if not told.timeline:
        return False
    start(told.timeline, capacity=told.timeline_events)
    return True


def start(path: str, capacity: int = DEFAULT_CAPACITY) -> None:
    """Record events from now on and write them to `path` at exit (or at `flush()`)."""
    global ENABLED, _events, _count, _capacity, _path, _rank, _size, _job, _epoch_offset_ns
    global _forward_from, _backward_from
    if capacity < 1:
        raise ValueError(f"timeline capacity {capacity}: give at least 1 event")
    from tandem import runtime

    if runtime.is_initialized():
        state = runtime.state()
        _rank, _size = state.world.rank, state.world.size
        _job = f"{state.job.master_addr or 'local'}-{state.job.master_port or os.getppid()}"
    else:
        _rank, _size, _job = 0, 1, f"pid{os.getpid()}"
    _events, _count, _capacity = [None] * capacity, 0, capacity
    _path = os.path.abspath(path)
    _epoch_offset_ns = time.time_ns() - time.perf_counter_ns()
    _forward_from, _backward_from = time.perf_counter_ns(), 0
    atexit.unregister(flush)
    atexit.register(flush)
    ENABLED = True


def stop() -> None:
    """Stop recording and forget the buffer without writing it."""
    global ENABLED, _events, _count, _path
    ENABLED, _events, _count, _path = False, [], 0, None
    atexit.unregister(flush)


# --- writing ---------------------------------------------------------------------------------


def _chrome_events() -> list[dict[str, Any]]:
    first = max(0, _count - _capacity)
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": _rank, "tid": 0,
         "args": {"name": f"rank {_rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": _rank, "tid": 0,
         "args": {"sort_index": _rank}},
    ]
    threads: set[int] = set()
    for i in range(first, _count):
        name, start_ns, end_ns, tid, args = _events[i % _capacity]
        threads.add(tid)
        event = {"ph": "X", "name": name, "pid": _rank, "tid": tid,
                 "ts": (start_ns + _epoch_offset_ns) / 1e3, "dur": max(0, end_ns - start_ns) / 1e3,
                 "cat": "communication" if tid >= BUCKET0 else _THREAD_NAMES.get(tid, "compute")}
        if args:
            event["args"] = args
        out.append(event)
    for tid in sorted(threads):
        label = _THREAD_NAMES.get(tid, f"bucket {tid - BUCKET0}" if tid >= BUCKET0 else str(tid))
        out.append({"ph": "M", "name": "thread_name", "pid": _rank, "tid": tid,
                    "args": {"name": label}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": _rank, "tid": tid,
                    "args": {"sort_index": tid}})
    return out


def _write_json(path: str, body: dict[str, Any]) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        json.dump(body, file)
    os.replace(temporary, path)  # readers never see half a file


def flush() -> str | None:
    """Write this rank's events; the last rank to write merges the trace. Returns its path."""
    if _path is None:
        return None
    part = {"rank": _rank, "size": _size, "recorded": _count,
            "dropped": max(0, _count - _capacity), "traceEvents": _chrome_events()}
    if _size == 1:
        merge_parts(_path, [part])
        return _path
    parts_dir = f"{_path}.parts"
    os.makedirs(parts_dir, exist_ok=True)
    _write_json(os.path.join(parts_dir, f"{_job}.rank{_rank}.json"), part)
    found = sorted(glob.glob(os.path.join(parts_dir, f"{glob.escape(_job)}.rank*.json")))
    if len(found) < _size:
        return None  # a later rank merges
    try:
        merge_files(_path, found)
    except FileNotFoundError:
        return None  # a rank finishing at the same moment merged (and removed) them first
    for name in found:
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
    with contextlib.suppress(OSError):
        os.rmdir(parts_dir)  # only when empty: parts of other jobs stay
    return _path


def merge_parts(path: str, parts: Sequence[dict[str, Any]]) -> None:
    """Write one Chrome trace from per-rank parts, with time starting at the earliest event."""
    events = [event for part in parts for event in part["traceEvents"]]
    stamps = [event["ts"] for event in events if "ts" in event]
    origin = min(stamps) if stamps else 0.0
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
    dropped = {str(part["rank"]): part["dropped"] for part in parts if part.get("dropped")}
    _write_json(path, {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"ranks": sorted(part["rank"] for part in parts),
                      "origin_epoch_us": origin, "dropped_events": dropped},
    })


def merge_files(path: str, names: Sequence[str]) -> None:
    """Merge per-rank part files into one trace at `path`."""
    parts = []
    for name in names:
        with open(name) as file:
            parts.append(json.load(file))
    merge_parts(path, parts)


if __name__ == "__main__":  # python -m tandem.diagnostics.timeline OUT PART...
    if len(sys.argv) < 3:
        sys.exit("usage: python -m tandem.diagnostics.timeline trace.json PART.json [PART.json ...]")
    merge_files(sys.argv[1], sys.argv[2:])
