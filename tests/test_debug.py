"""Debug mode: every user-facing collective carries a fingerprint (sequence number, call site).

Ranks that skipped a collective and are in another, or pass different arguments, all raise
one `CollectiveMismatchError` that shows each rank's call (#n, arguments, line) side by side;
the same collective from two lines is a warning, once (code may branch on the rank). The world
stays usable afterwards (nothing was sent). A skip into an operation that is not a
collective (a receive) is the watchdog's job: see test_faults.py.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import tandem as td
from tandem import runtime
from tandem.comm.agreement import checks, fingerprints
from tandem.testing import run_distributed

DEBUG = {"TANDEM_DEBUG": "1"}


def _line() -> int:
    return sys._getframe(1).f_lineno


def _mismatch(call) -> str:
    try:
        call()
    except td.CollectiveMismatchError as error:
        return str(error)
    raise AssertionError("the ranks should have disagreed")


def check_fingerprints():
    assert runtime.state().debug
    me = td.rank()
    found = {}
    for _ in range(3):  # the same line on every rank: no complaint
        td.allreduce(torch.ones(2))
    td.barrier()
    assert td.broadcast_object({"from": me}, root=0) == {"from": 0}

    def different_lines():
        if me == 0:
            td.allreduce(torch.ones(2))
        else:
            td.allreduce(torch.ones(2))

    warned = len(checks._warned_sites)
    different_lines()  # the same collective from two lines: a warning (code may branch on rank)
    different_lines()  # ...said once
    found["warned"] = len(checks._warned_sites) - warned

    def different_lines_and_shapes():
        if me == 0:
            td.allreduce(torch.ones(2))
        else:
            td.allreduce(torch.ones(4))

    found["lines"] = _mismatch(different_lines_and_shapes)
    found["lines_at"] = different_lines_and_shapes.__code__.co_firstlineno

    def skip_into_barrier():
        if me == 0:
            td.allreduce(torch.ones(3), op="sum")
        else:
            td.barrier()

    found["skip"] = _mismatch(skip_into_barrier)

    def skip_into_gather():
        if me == 0:
            td.barrier()
        else:
            td.allgather_object("x")

    found["gather"] = _mismatch(skip_into_gather)
    found["sum"] = td.allreduce(torch.ones(1), op="sum").item()  # still usable
    found["seq"] = fingerprints._sequence.get("world")
    return found


@pytest.mark.timeout(150)
def test_ranks_that_disagree_all_see_each_call_side_by_side():
    results = run_distributed(check_fingerprints, world_size=2, env=DEBUG)
    first = results[0]["lines_at"]
    for found in results:
        assert found["sum"] == 2.0
        lines = found["lines"].splitlines()
        assert lines[0].startswith("ranks called a collective with different arguments")
        assert found["warned"] == 1
        assert re.fullmatch(rf"  rank 0: #(\d+) allreduce\(shape=\(2,\), dtype=float32, "
                            rf"op='mean'\) at test_debug.py:{first + 2}", lines[1]), lines[1]
        assert "shape=(4,)" in lines[2] and lines[2].endswith(f"at test_debug.py:{first + 4}")
        assert "from the same lines" in found["lines"]
        skip = found["skip"]
        assert re.search(r"rank 0: #\d+ allreduce\(shape=\(3,\), dtype=float32, op='sum'\) at",
                         skip)
        assert re.search(r"rank 1: #\d+ barrier\(\) at test_debug.py:\d+", skip)
        assert re.search(r"rank 0: #\d+ barrier\(\)", found["gather"])
        assert re.search(r"rank 1: #\d+ allgather_object\(\)", found["gather"])
    # both ranks counted the same collectives, mismatches included
    assert results[0]["seq"] == results[1]["seq"]


def test_fingerprints_name_the_users_line_not_tandems():
    mark = fingerprints.next_fingerprint("allreduce", "test-stream")
    assert mark.site == f"test_debug.py:{_line() - 1}"
    again = fingerprints.next_fingerprint("allreduce", "test-stream")
    assert (mark.seq + 1, str(again)) == (again.seq, f"#{again.seq} allreduce at {again.site}")
    fingerprints.reset()
    assert fingerprints.next_fingerprint("barrier", "test-stream").seq == 1
    fingerprints.reset()
