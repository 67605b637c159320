"""The watchdog: its conclusions as pure functions, then real jobs that hang or lose a peer.

The jobs run through `python -m tandem run` with a small TANDEM_TIMEOUT, as a user would see
them; the bounds on how long they take are generous (two shared cores), the contract is
"ends with the report instead of hanging".
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tandem as td
from tandem import runtime
from tandem.comm.agreement import fingerprints
from tandem.comm.watchdog import waitgraph
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def tandem_run(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       base.get("PYTHONPATH")]))
    base.update(env or {})
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=base,
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


# --- conclusions, without processes --------------------------------------------------------

def _op(kind, stream, index, members, peer=None, tag=None, detail="float32[3]"):
    return {"kind": kind, "stream": stream, "index": index, "members": members,
            "detail": detail, "peer": peer, "tag": tag}


def _answer(rank, issued, waits=(), state="running", stack=""):
    return {"rank": rank, "pid": 100 + rank, "host": "h", "state": state, "issued": issued,
            "waits": list(waits), "stack": stack}


def _wait(op, age=2.0, timeout=5.0, entry="td.allreduce", site="train.py:10"):
    return {"op": op, "age": age, "timeout": timeout, "serial": 1, "entry": entry,
            "site": site, "fingerprint": None}


def test_arrival_counts_what_each_peer_has_issued_on_the_stream():
    op = _op("allreduce", "world", 5, [0, 1, 2, 3])
    answers = {0: _answer(0, {"world": 5}), 1: _answer(1, {"world": 5}),
               2: _answer(2, {"world": 4}), 3: None}
    assert waitgraph.arrival(op, 0, answers) == ([0, 1], [2], [3])


def test_a_computing_rank_never_closes_a_cycle():
    allreduce = _op("allreduce", "world", 5, [0, 1])
    answers = {0: _answer(0, {"world": 5}, [_wait(allreduce)]), 1: _answer(1, {"world": 4})}
    assert waitgraph.find_desync(answers, grace=1.0) is None


def test_ranks_waiting_for_each_other_are_a_desync():
    allreduce = _op("allreduce", "world", 5, [0, 1])
    recv = _op("recv", "world 0->1 tag 0", 1, [0, 1], peer=0, tag=0)
    answers = {0: _answer(0, {"world": 5}, [_wait(allreduce)]),
               1: _answer(1, {"world": 4, "world 0->1 tag 0": 1},
                          [_wait(recv, entry="td.recv", site="train.py:14")])}
    desync = waitgraph.find_desync(answers, grace=1.0)
    assert desync.kind == "cycle" and desync.ranks == (0, 1) and desync.reporter == 0
    assert "rank 1 has not reached it (it has issued 4 operation(s)" in desync.lines[0]
    assert "recv #1 from rank 0 (tag 0, float32[3]), called as td.recv at train.py:14" \
        in desync.lines[1]
    # the same picture, but young waits (under the grace) prove nothing yet
    assert waitgraph.find_desync(answers, grace=10.0) is None


def test_different_operations_at_one_place_of_a_stream_are_a_desync():
    answers = {0: _answer(0, {"world": 3}, [_wait(_op("allreduce", "world", 3, [0, 1]))]),
               1: _answer(1, {"world": 3}, [_wait(_op("barrier", "world", 3, [0, 1],
                                                      detail=""))])}
    desync = waitgraph.find_desync(answers, grace=1.0)
    assert desync.kind == "mismatch" and desync.ranks == (0, 1)


def test_waiting_for_a_rank_that_left_is_a_desync():
    answers = {0: _answer(0, {"world": 3}, [_wait(_op("allreduce", "world", 3, [0, 1]))]),
               1: _answer(1, {"world": 2}, state="left")}
    desync = waitgraph.find_desync(answers, grace=1.0)
    assert desync.kind == "left" and "left the job" in desync.lines[1]


def test_timeout_report_names_who_arrived_and_groups_identical_stacks():
    op = _op("allreduce", "world", 7, [0, 1, 2, 3])
    stack_a = '  File "train.py", line 3, in <module>\n'
    answers = {0: _answer(0, {"world": 7}, [_wait(op, age=5.0)], stack=stack_a),
               1: _answer(1, {"world": 7}, [_wait(op, age=4.0)], stack=stack_a),
               2: _answer(2, {"world": 6}, stack='  File "train.py", line 9, in <module>\n'),
               3: None}
    report = waitgraph.timeout_report(0, answers[0]["waits"][0], answers)
    assert "arrived:     ranks 0, 1" in report
    assert "not arrived: ranks 2, 3" in report
    assert "rank 2: computing, not in any tandem operation (it has issued 6" in report
    assert "rank 3: did not answer the watchdog" in report
    assert "--- ranks 0 (pid 100 on h), 1 (pid 101 on h):" in report
    assert report.splitlines()[-1].startswith("tandem watchdog: rank 0 gives up on allreduce #7")


def test_a_stopped_rank_is_the_cause_even_when_another_waits_elsewhere():
    # Rank 2 is stopped (SIGSTOP: it never answers); rank 1 waits at the same place in another
    # operation it cannot finish either. The rank to blame is the one that never arrived.
    allreduce = _op("allreduce", "world", 4, [0, 1, 2])
    answers = {0: _answer(0, {"world": 4}, [_wait(allreduce)]),
               1: _answer(1, {"world": 4}, [_wait(_op("barrier", "world", 4, [0, 1, 2],
                                                      detail=""))]),
               2: None}
    last = waitgraph.timeout_report(0, answers[0]["waits"][0], answers).splitlines()[-1]
    assert "waiting for rank 2" in last and "different operation" not in last, last
    # with every member there, the different operation is the answer
    answers[2] = _answer(2, {"world": 4}, [_wait(allreduce)])
    last = waitgraph.timeout_report(0, answers[0]["waits"][0], answers).splitlines()[-1]
    assert "rank 1 called a different operation there" in last, last


def test_call_sites_skip_tandem_frames():
    def user_code():
        return fingerprints.call_site()

    assert fingerprints.call_site() == f"test_watchdog.py:{sys._getframe().f_lineno}"
    assert user_code().startswith("test_watchdog.py:")


# --- real jobs -----------------------------------------------------------------------------

needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=needs_mpi)])
def test_a_hang_is_reported_with_who_arrived_and_every_stack(backend):
    # On MPI too: `tandem run` gives MPI ranks its store, so rank 1's stack reaches rank 0.
    result, elapsed = tandem_run("-np", "2", "--backend", backend, str(SCRIPTS / "fault_train.py"),
                                 "hang", "--steps", "6", "--at", "2", env={"TANDEM_TIMEOUT": "4"})
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert "WatchdogTimeout" in err
    assert "arrived:     rank 0" in err and "not arrived: rank 1" in err
    assert "rank 1: computing, not in any tandem operation" in err
    assert "threading.Event().wait()" in err  # rank 1's own stack, fetched from rank 1
    assert "called as td.allreduce at fault_train.py:" in err
    assert "tandem run: job failed: rank 0" in err
    print(f"hang reported and job ended {elapsed:.1f} s after start")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, reason", [
    ("died", "rank 1 is unreachable: it did not answer the watchdog"),
    ("left", "rank 1 has left the job"),
])
def test_a_lost_peer_is_named(how, reason):
    # Gloo only: this is the watchdog reading Gloo's "Connection closed by peer" within
    # seconds. MPI does not notice a peer that left; there the wait ends at the timeout,
    # with rank 1 reported as not answering (died) or in the summary (left).
    result, _ = tandem_run("-np", "2", "--backend", "gloo", str(SCRIPTS / "fault_peer.py"), how,
                           env={"TANDEM_TIMEOUT": "20"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "PeerUnreachableError" in result.stderr
    assert reason in result.stderr
    assert "allreduce #" in result.stderr and "The engine said:" in result.stderr
    assert "not reached" not in result.stdout


# --- the same watchdog over MPI without `tandem run` (no store: this rank's view only) ------

def check_mpi_timeout_is_explained():
    if td.rank() == 0:
        try:
            td.recv(torch.zeros(2), src=1, tag=7)
        except td.WatchdogTimeout as error:
            message = str(error)
        else:
            raise AssertionError("the receive should have timed out")
        td.send(torch.ones(1), dst=1, tag=8)  # let rank 1 go on: the world stays usable
        return message
    box = torch.zeros(1)
    runtime.get_backend().recv(box, 0, 8, None).wait(60)  # longer than rank 0's timeout
    return None


def test_mpi_timeouts_come_from_the_same_watchdog():
    pytest.importorskip("mpi4py")
    message = run_distributed(check_mpi_timeout_is_explained, world_size=2, backend="mpi",
                              env={"TANDEM_TIMEOUT": "2"})[0]
    assert "recv #1 from rank 1 (tag 7, float32[2])" in message
    assert "not arrived: rank 1" in message
    assert "no rendezvous store" in message
