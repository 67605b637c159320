"""The MPI backend (mpi4py): the whole collective matrix, then what is particular to MPI.

The matrix reuses the checks of test_collectives.py unchanged, on worlds started by
`mpiexec -n N`. The MPI-specific checks cover what Gloo does not exercise: reductions in
dtypes MPI lacks (float16/bfloat16 through float32 stand-ins), a group whose ranks are neither
contiguous nor in order, several operations in flight completed out of order (and moved along
by the progress thread with nobody waiting), and timeouts that name the missing peer.
"""

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import mismatch, rank_data, reference
from jobs_ahead import Ahead, Command
from test_collectives import (
    CHECKS,
    SIZES,
    check_handle_polls,
    check_seed_program,
)

import tandem as td
from tandem import runtime
from tandem.testing import mpiexec_command, run_distributed

pytest.importorskip("mpi4py")

SCRIPTS = Path(__file__).parent / "scripts"


def _engine():
    """The MPI backend itself (td.init wraps it in the watchdog, whose works wrap ours)."""
    backend = runtime.get_backend()
    return getattr(backend, "inner", backend)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matches_numpy_on_mpi(check, world_size):
    run_distributed(check, world_size=world_size, backend="mpi")


def test_seed_program_on_mpi():
    results = run_distributed(check_seed_program, world_size=2, backend="mpi")
    assert results == [(None, 3.0), ([1.0, -1.0], 3.0)]


def test_handle_done_and_wait_twice_on_mpi():
    run_distributed(check_handle_polls, world_size=2, backend="mpi")


# -- dtypes MPI cannot reduce ---------------------------------------------------------------
def check_half_precision():
    """float16/bfloat16 (and bool) reductions, many in flight at once, sharing pool sizes."""
    backend = runtime.get_backend()
    members = list(range(td.size()))
    errors = []
    for dtype in (torch.float16, torch.bfloat16):
        for op in ("sum", "min", "max", "product"):
            shape = (64, 33)
            datas = [rank_data(r, dtype, shape=shape, op=op) for r in members]
            expected = reference([d.double().numpy() for d in datas], op, integer=False)
            # Three same-sized buffers in flight: each needs its own float32 stand-in.
            tensors = [datas[td.rank()].clone() for _ in range(3)]
            works = [backend.allreduce(t, op, None) for t in tensors]
            for i in (2, 0, 1):
                works[i].wait(30)
                errors.append(mismatch(f"{dtype} {op} inflight{i}", tensors[i], expected, dtype))
            result = td.reduce(datas[td.rank()], root=0, op=op)
            if td.rank() == 0:
                errors.append(mismatch(f"{dtype} {op} reduce", result, expected, dtype))
    # Rounding happens once, after a float32 sum: 1 + 2^-9 per rank is lost in a bfloat16
    # running sum but not in ours.
    small = torch.full((10,), 2.0**-9 if td.rank() else 1.0, dtype=torch.bfloat16)
    total = td.allreduce(small, op="sum")
    want = torch.tensor(1.0 + (td.size() - 1) * 2.0**-9).to(torch.bfloat16).item()
    if total[0].item() != want:
        errors.append(f"bfloat16 rounding: got {total[0].item()} expected {want}")
    flags = torch.tensor([td.rank() == 0, True, False])
    if td.allreduce(flags, op="max").tolist() != [True, True, False]:
        errors.append("bool max")
    assert not any(errors), "\n".join(e for e in errors if e)


def test_half_precision_reductions():
    run_distributed(check_half_precision, world_size=3, backend="mpi")


# -- groups ---------------------------------------------------------------------------------
_groups: dict = {}


def check_scattered_group():
    """Group [3, 1] (reversed, not contiguous) beside [0, 2]; roots and peers are global ranks."""
    if "groups" not in _groups:
        _groups["groups"] = (td.new_group([3, 1]), td.new_group([0, 2]))
    odd, even = _groups["groups"]
    me = td.rank()
    group = odd if me in (1, 3) else even
    members = list(group.ranks)
    assert group.rank == members.index(me)
    value = torch.tensor([float(me + 1)])
    # in place and returned: the sum lands in the tensor given (a copy keeps `value`)
    assert td.allreduce(value.clone(), op="sum", group=group).item() == sum(r + 1 for r in members)
    assert td.broadcast(value.clone(), root=members[1], group=group).item() == members[1] + 1
    reduced = td.reduce(value, root=members[1], op="max", group=group)
    if me == members[1]:
        assert reduced.item() == max(members) + 1
    # Gathered in group order: [3, 1] gives rank 3's rows first.
    gathered = td.allgather(torch.tensor([me, me]), group=group)
    assert gathered.tolist() == [r for r in members for _ in range(2)], gathered
    scattered = td.reducescatter(torch.arange(4.0) + me, op="sum", group=group)
    base = torch.arange(4.0)[2 * group.rank : 2 * group.rank + 2]
    assert scattered.tolist() == (base * 2 + sum(members)).tolist()
    # Uneven all-to-all, including an empty part: member j gets j rows from everyone.
    outgoing = torch.full((1, 3), float(me))
    received = td.alltoall(outgoing, splits=[0, 1], group=group)
    assert received.tolist() == ([[float(r)] * 3 for r in members] if group.rank == 1 else [])
    # Point to point inside the group, addressed by global rank.
    other = members[1 - group.rank]
    box = torch.zeros(2)
    handle = td.recv(box, src=other, tag=7, group=group, async_op=True)
    td.send(torch.tensor([me, -me], dtype=torch.float32), dst=other, tag=7, group=group)
    handle.wait()
    assert box.tolist() == [other, -other]
    td.barrier(group=group)


def test_scattered_group():
    run_distributed(check_scattered_group, world_size=4, backend="mpi")


# -- overlap and progress -------------------------------------------------------------------
def check_in_flight_out_of_order():
    backend = _engine()
    sizes = [1, 1000, 1 << 18, 17, 1 << 20]
    tensors = [torch.full((n,), float(td.rank() + 1)) for n in sizes]
    works = [backend.allreduce(t, "sum", None) for t in tensors]
    handles = [td.allreduce(torch.full((n,), 1.0), op="mean", async_op=True) for n in sizes]
    expected = sum(range(1, td.size() + 1))
    for i in reversed(range(len(sizes))):
        works[i].wait(30)
        assert torch.all(tensors[i] == expected), (sizes[i], tensors[i][:4])
        assert torch.all(handles[(i + 2) % len(sizes)].wait() == 1.0)
    # Posted, then left alone: the progress thread completes it with no MPI call from us.
    assert type(backend).__name__ == "MPIBackend" and backend.progress.threaded
    big = torch.ones(1 << 20)
    work = backend.allreduce(big, "sum", None)
    deadline = time.monotonic() + 30
    idle = threading.Event()
    while work in backend.progress.outstanding and time.monotonic() < deadline:
        idle.wait(0.01)  # no MPI call here: only the progress thread can finish it
    assert work not in backend.progress.outstanding, "nothing progressed the all-reduce"
    work.wait(1)
    assert torch.all(big == td.size())


def test_in_flight_out_of_order_and_progress():
    # The thread is forced: by default it runs only when a core is spare (see below).
    run_distributed(check_in_flight_out_of_order, world_size=2, backend="mpi",
                    env={"TANDEM_MPI_PROGRESS": "thread"})


def test_progress_thread_only_with_a_spare_core(monkeypatch):
    from tandem.comm.engines import mpi_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mpi_setup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not mpi_setup.spare_core(local_size=2)  # 2 ranks x 2 threads fill 4 cores
    assert mpi_setup.spare_core(local_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mpi_setup.spare_core(local_size=2)  # compute runs on the GPUs


def check_large_allreduce_in_pieces():
    """From 8 MB an all-reduce goes to MPI in 4 MB pieces: every element, every dtype, every path."""
    from tandem.comm.engines import mpi_backend

    me, n = td.rank(), td.size()
    count = (mpi_backend.PIECES_FROM_BYTES // 4) * 2 + 3  # 16 MB of float32 and a ragged end
    values = torch.arange(count, dtype=torch.float32) % 1000 + me
    summed = td.allreduce(values, op="sum")  # allreduce_now
    expected = n * (torch.arange(count, dtype=torch.float32) % 1000) + sum(range(n))
    assert torch.equal(summed, expected)
    big_ints = torch.full((count // 2,), me + 1, dtype=torch.int64)  # 8-byte items
    assert torch.all(td.allreduce(big_ints, op="max", async_op=True).wait() == n)
    halves = torch.full((count,), 0.5, dtype=torch.bfloat16)  # reduced in a float32 stand-in
    assert torch.all(td.allreduce(halves, op="sum") == 0.5 * n)


def test_large_allreduce_in_pieces():
    run_distributed(check_large_allreduce_in_pieces, world_size=2, backend="mpi")


def check_edges():
    """Empty tensors, zero-row splits, bad input: clear errors, never a hang."""
    backend = runtime.get_backend()
    assert td.allreduce(torch.empty(0), op="sum").numel() == 0
    assert td.broadcast(torch.empty(0, 3)).shape == (0, 3)
    n = td.size()
    splits = [0] * n
    splits[0] = 2
    received = td.alltoall(torch.ones(2, 2) * td.rank(), splits=splits)
    assert received.shape == ((2 * n, 2) if td.rank() == 0 else (0, 2))
    with pytest.raises(ValueError, match="contiguous"):
        backend.allreduce(torch.ones(3, 4).t(), "sum", None)
    with pytest.raises(ValueError, match="tags must be between"):
        backend.send(torch.ones(1), (td.rank() + 1) % n, -1, None)
    with pytest.raises(ValueError, match="not a rank of the group"):
        backend.broadcast(torch.ones(1), n + 5, None)
    assert td.allreduce(torch.ones(2, dtype=torch.int64), op="sum").tolist() == [n, n]


def test_edges():
    run_distributed(check_edges, world_size=2, backend="mpi")


# -- timeouts -------------------------------------------------------------------------------
def check_timeouts():
    """A peer that never sends, then a peer that never arrives: each a TimeoutError naming it."""
    me = td.rank()
    messages = []
    if me == 0:
        with pytest.raises(TimeoutError) as raised:
            td.recv(torch.zeros(4), src=1, tag=3)
        messages.append(str(raised.value))
        # Without argument checks, so that rank 1 can complete exactly the operations left.
        runtime.state().checks = False
        with pytest.raises(TimeoutError) as raised:
            td.barrier()
        messages.append(str(raised.value))
        # A blocking all-reduce first drives MPI itself (allreduce_now), then waits watched.
        with pytest.raises(TimeoutError) as raised:
            td.allreduce(torch.ones(3), op="sum")
        messages.append(str(raised.value))
        td.send(torch.ones(1), dst=1, tag=9)  # tell rank 1 to enter what we left
    else:
        box = torch.zeros(1)
        work = runtime.get_backend().recv(box, 0, 9, None)
        work.wait(60)
        runtime.state().checks = False
        td.barrier()  # completes rank 0's abandoned barrier ...
        td.allreduce(torch.ones(3), op="sum")  # ... and all-reduce: the world is clean again
    runtime.state().checks = True
    total = td.allreduce(torch.ones(1), op="sum").item()
    return messages, total


def test_timeouts_name_the_peer():
    results = run_distributed(check_timeouts, world_size=2, backend="mpi",
                              env={"TANDEM_TIMEOUT": "2"})
    (recv_message, barrier_message, allreduce_message), total = results[0]
    assert total == 2.0
    assert "allreduce((3,) float32, sum)" in allreduce_message and "[1]" in allreduce_message
    assert "recv" in recv_message and "from rank 1" in recv_message and "tag 3" in recv_message
    assert "within 2 s" in recv_message
    assert "barrier" in barrier_message and "[1]" in barrier_message


# -- jobs: started by mpiexec, and by tandem run --backend mpi --------------------------------
# Each is about a fresh job; they run side by side, ahead of their tests (tests/jobs_ahead.py).
ahead = Ahead()
jobs = ahead.fixture()


def _job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _tandem_run(*args: str) -> Command:
    return Command([sys.executable, "-m", "tandem", "run", "--backend", "mpi", *args], _job_env(),
                   None, 100)


@ahead.plan("test_mpiexec_script_picks_mpi_by_default")
def _(tmp):
    return [Command([*mpiexec_command(2), sys.executable, str(SCRIPTS / "mpi_allreduce.py")],
                    _job_env(), None, 100)]


@pytest.mark.timeout(120)
def test_mpiexec_script_picks_mpi_by_default(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    # mpiexec merges the ranks' output streams, so lines may run into each other.
    found = sorted(re.findall(r"rank (\d) of (\d): backend=(\w+) sum=(\d+)", done.stdout))
    assert found == [("0", "2", "mpi", "3"), ("1", "2", "mpi", "3")], done.stdout


@ahead.plan("test_tandem_run_mpi_prefixes_each_ranks_output")
def _(tmp):
    return [_tandem_run("-np", "2", str(SCRIPTS / "mpi_allreduce.py"))]


@pytest.mark.timeout(120)
def test_tandem_run_mpi_prefixes_each_ranks_output(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("["))
    assert lines == ["[0] rank 0 of 2: backend=mpi sum=3", "[1] rank 1 of 2: backend=mpi sum=3"]


@ahead.plan("test_tandem_run_mpi_stops_the_job_when_a_rank_fails")
def _(tmp, script):
    return [_tandem_run("-np", "2", str(SCRIPTS / script))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, code, fault", [
    ("mpi_fail.py", 1, "gives up"),  # an exception
    ("mpi_exit_code.py", 3, "exits"),  # sys.exit(3): no exception, yet a failure
], ids=["raise", "sys.exit"])
def test_tandem_run_mpi_stops_the_job_when_a_rank_fails(script, code, fault, jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == code, done.stdout + done.stderr
    assert re.search(rf"^\[1\] rank 1 {fault} at [\d.]+$", done.stdout, re.M), done.stdout
    # Rank 0 waits in a barrier for ever: the launcher stops it, not a watchdog's timeout.
    assert "stopping the other 1 rank(s)" in done.stderr, done.stderr
    assert "WatchdogTimeout" not in done.stderr and "timed out" not in done.stderr, done.stderr
    assert "job failed: rank 1" in done.stderr and f"exit code {code}" in done.stderr
    if script == "mpi_fail.py":
        assert "[1] RuntimeError: rank 1 cannot go on" in done.stderr
    # Stopping the job is the agent's: mpiexec neither races it nor explains it (Hydra runs
    # with -disable-auto-cleanup, Open MPI with --enable-recovery; see launch/mpi/mpiexec.py).
    assert "mpiexec:" not in done.stderr, done.stderr
