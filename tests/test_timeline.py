"""The timeline: a bounded per-rank ring, Chrome-trace parts merged into one valid JSON file.

The end-to-end test runs a real 2-rank job with TANDEM_TIMELINE set, exactly as a user would,
and checks the merged trace: both ranks, one reduction span per gradient bucket per step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.diagnostics import timeline
from tandem.job import settings

SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "scripts" / "scale_train.py")


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "trace.json"
    timeline.start(str(path), capacity=10)
    yield path
    timeline.stop()


def test_disabled_span_records_nothing_and_is_shared():
    assert not timeline.ENABLED
    assert timeline.span("a") is timeline.span("b")  # one shared no-op, nothing allocated
    with timeline.span("forward"):
        pass
    assert timeline.flush() is None


def test_ring_keeps_the_last_events_and_counts_the_dropped(recording):
    for i in range(25):
        with timeline.span("step", args={"i": i}):
            pass
    assert timeline.flush() == str(recording)
    trace = json.loads(recording.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["i"] for e in spans] == list(range(15, 25))
    assert trace["otherData"]["dropped_events"] == {"0": 15}
    assert min(e["ts"] for e in spans) == 0  # time starts at the first event
    assert all(e["dur"] >= 0 for e in spans)
    names = {e["args"].get("name") for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "compute"} <= names


def test_parts_of_two_ranks_merge_into_one_trace(tmp_path):
    parts = []
    for rank in (0, 1):
        events = [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "X", "name": "allreduce", "pid": rank, "tid": timeline.BUCKET0, "ts": 1000.0 + rank,
             "dur": 5.0, "cat": "communication"},
        ]
        part = tmp_path / f"job.rank{rank}.json"
        part.write_text(json.dumps({"rank": rank, "size": 2, "dropped": 0, "traceEvents": events}))
        parts.append(str(part))
    out = tmp_path / "trace.json"
    timeline.merge_files(str(out), parts)
    trace = json.loads(out.read_text())
    assert trace["otherData"]["ranks"] == [0, 1]
    assert sorted(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == [0.0, 1.0]


def test_bad_capacity_names_the_value(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_TIMELINE", str(tmp_path / "t.json"))
    monkeypatch.setenv("TANDEM_TIMELINE_EVENTS", "lots")
    with pytest.raises(ValueError, match="TANDEM_TIMELINE_EVENTS='lots'"):
        settings.reload()  # a process reads its settings once; this one changed them
        timeline.configure()
    assert not timeline.ENABLED


# --- a real 2-rank job --------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_two_rank_job_writes_one_trace_with_every_bucket_every_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_TIMELINE"] = "trace.json"  # relative: each rank resolves it in the job's cwd
    command = [sys.executable, "-m", "tandem", "run", "-np", "2", SCRIPT, "--hidden", "64",
               "--layers", "4", "--bucket-mb", "0.01", "--epochs", "1", "--samples", "256", "--batch", "64"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    steps, buckets = map(int, re.search(r"done: (\d+) steps, .* (\d+) buckets", result.stdout).groups())
    assert steps == 4 and buckets >= 2
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]  # the parts were merged and removed

    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert trace["otherData"]["ranks"] == [0, 1]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        step_ends = sorted(e["ts"] + e["dur"] for e in mine if e["name"] == "optimizer step")
        assert len(step_ends) == steps
        for bucket in range(buckets):
            reductions = sorted(e["ts"] for e in mine
                                if e["name"] == "allreduce" and e["tid"] == timeline.BUCKET0 + bucket)
            assert len(reductions) == steps, (rank, bucket, reductions)
            # one reduction per step: the k-th starts after step k-1 ended
            for k in range(1, steps):
                assert step_ends[k - 1] <= reductions[k] + 1e-3
        names = [e["name"] for e in mine]
        for name in ("forward", "backward", "optimizer step", "data"):
            assert names.count(name) >= steps, (rank, name, names.count(name))
        assert names.count("wait") == steps * buckets
        labels = {e["args"]["name"] for e in trace["traceEvents"]
                  if e["ph"] == "M" and e["pid"] == rank and e["name"] == "thread_name"}
        assert {f"bucket {b}" for b in range(buckets)} <= labels
