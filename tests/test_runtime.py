"""init / spawn / argument agreement across real processes, and bad input of every kind."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from jobs_ahead import Ahead, Command

import tandem as td
from tandem import runtime
from tandem.testing import run_distributed


def _clean(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without launcher variables, and `env`."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("TANDEM_", "PMI_", "OMPI_", "SLURM_"))
             and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    return clean


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 60):
    """Run `code` in a fresh interpreter with no launcher variables; return the process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_clean(env),
                          capture_output=True, text=True, timeout=timeout)


# The fresh interpreters of the tests below (each is about a process no launcher started) run
# side by side, ahead of their tests (tests/jobs_ahead.py).
ahead = Ahead()
jobs = ahead.fixture()


def _python_command(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> Command:
    return Command([sys.executable, "-c", textwrap.dedent(code)], _clean(env), None, timeout)


WORLD_OF_ONE = """
    import torch, tandem as td
    world = td.init()
    print(world.rank, world.size, world.backend, world.device)
    print(td.allreduce(torch.tensor([2.0, 4.0])).tolist(), td.allgather(torch.ones(2)).shape)
    td.barrier(); td.shutdown()
"""


@ahead.plan("test_script_without_launcher_is_a_world_of_one")
def _(tmp):
    return [_python_command(WORLD_OF_ONE)]


def test_script_without_launcher_is_a_world_of_one(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0 1 gloo cpu", "[2.0, 4.0] torch.Size([2])"]


def test_rendezvous_port_taken_by_another_program_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _python("import tandem as td; td.init()", env={
            "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use by another program" in done.stderr


@ahead.plan("test_multi_rank_job_without_a_port_says_how_to_fix_it")
def _(tmp):
    return [_python_command("import tandem as td; td.init()", env={"RANK": "0", "WORLD_SIZE": "2"})]


def test_multi_rank_job_without_a_port_says_how_to_fix_it(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode != 0
    assert "needs a rendezvous port; set MASTER_ADDR and MASTER_PORT" in done.stderr


@ahead.plan("test_unknown_backend_and_bad_timeout")
def _(tmp):
    return [_python_command("import tandem as td; td.init(backend='carrier-pigeon')"),
            _python_command("import tandem as td; td.init(timeout=-1)")]


def test_unknown_backend_and_bad_timeout(jobs, request):
    (pigeon, negative), _ = jobs.take(request.node)
    assert "unknown backend 'carrier-pigeon': choose one of gloo, nccl, mpi" in pigeon.stderr
    assert "timeout must be positive" in negative.stderr


def test_not_initialised_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"call td.init\(\) first"):
        td.rank()


def check_init_is_idempotent():
    first = td.init()
    assert td.init() is first and td.init(backend="gloo") is first
    with pytest.raises(ValueError, match="already initialised with backend 'gloo'"):
        td.init(backend="mpi")
    assert (td.rank(), td.size(), td.local_rank(), td.local_size()) == (
        first.rank, first.size, first.local_rank, first.local_size)
    assert td.is_initialized() and td.device() == torch.device("cpu")


def test_init_twice():
    run_distributed(check_init_is_idempotent, world_size=2)


def check_mismatched_arguments():
    """Each disagreement raises on every rank, names every rank's call, and sends nothing."""
    me = td.rank()
    messages = []
    cases = [
        lambda: td.allreduce(torch.ones(3 + me)),                          # shape
        lambda: td.allreduce(torch.ones(3, dtype=[torch.float32, torch.float64][me % 2])),
        lambda: td.allreduce(torch.ones(3), op=["sum", "max"][me % 2]),    # op
        lambda: td.broadcast(torch.ones(3), root=me),                      # root
        lambda: (td.allreduce if me == 0 else td.broadcast)(torch.ones(3)),  # collective
        lambda: td.allgather(torch.ones(2, 3 + me)),                       # trailing dims
    ]
    for case in cases:
        with pytest.raises(td.CollectiveMismatchError) as raised:
            case()
        messages.append(str(raised.value))
    # The world still works afterwards: nothing was half-sent.
    assert td.allreduce(torch.ones(2), op="sum").tolist() == [td.size()] * 2
    return messages


def test_mismatched_shapes_dtypes_ops_roots_are_named_per_rank():
    messages = run_distributed(check_mismatched_arguments, world_size=2)
    assert messages[0] == messages[1]  # every rank raises the same error
    shape, dtype, op, root, collective, trailing = messages[0]
    assert "rank 0: allreduce(shape=(3,), dtype=float32, op='mean')" in shape
    assert "rank 1: allreduce(shape=(4,), dtype=float32, op='mean')" in shape
    assert "rank 1: allreduce(shape=(3,), dtype=float64" in dtype
    assert "op='sum'" in op and "op='max'" in op
    assert "root=0" in root and "root=1" in root
    assert "rank 0: allreduce(" in collective and "rank 1: broadcast(" in collective
    assert "shape=(*, 3)" in trailing and "shape=(*, 4)" in trailing


def check_argument_errors():
    with pytest.raises(ValueError, match="unknown op 'avg'"):
        td.allreduce(torch.ones(2), op="avg")
    with pytest.raises(ValueError, match=r"root=5 is not a rank of the group \[0, 1\]"):
        td.broadcast(torch.ones(2), root=5)
    with pytest.raises(ValueError, match="dim 0 divisible by the group size 2"):
        td.reducescatter(torch.ones(3))
    with pytest.raises(ValueError, match="splits .* must be 2 non-negative counts"):
        td.alltoall(torch.ones(4), splits=[1, 2])
    with pytest.raises(TypeError, match="must be a torch.Tensor or numpy.ndarray, not list"):
        td.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="cannot send to itself"):
        td.send(torch.ones(1), dst=td.rank())
    with pytest.raises(ValueError, match="new_group got a rank twice"):
        td.new_group([0, 0])
    with pytest.raises(ValueError, match=r"mesh\(dp=3, pp=1, tp=1\) needs 3 ranks, but the world has 2"):
        td.mesh(dp=3, pp=1)


def test_argument_errors_name_the_value_and_the_fix():
    run_distributed(check_argument_errors, world_size=2)


def check_non_member_cannot_use_group():
    group = td.new_group([0])
    if td.rank() == 1:
        with pytest.raises(ValueError, match="rank 1 is not a member of Group"):
            td.allreduce(torch.ones(1), group=group)
    else:
        assert td.allreduce(torch.ones(1), op="sum", group=group).tolist() == [1.0]


def test_non_member_of_group():
    run_distributed(check_non_member_cannot_use_group, world_size=2)


def check_checks_are_off():
    return runtime.state().checks


def test_checks_can_be_turned_off():
    assert run_distributed(check_checks_are_off, world_size=2,
                           env={"TANDEM_CHECKS": "0"}) == [False, False]


def check_mesh_layout():
    mesh = td.mesh(dp=2, pp=2)
    total = td.allreduce(torch.tensor([float(td.rank())]), op="sum", group=mesh.dp_group)
    return mesh.dp_rank, mesh.pp_rank, list(mesh.dp_group.ranks), list(mesh.pp_group.ranks), total.item()


def test_mesh_groups_replicas_and_stages():
    results = run_distributed(check_mesh_layout, world_size=4)
    assert results == [
        (0, 0, [0, 2], [0, 1], 2.0), (0, 1, [1, 3], [0, 1], 4.0),
        (1, 0, [0, 2], [2, 3], 2.0), (1, 1, [1, 3], [2, 3], 4.0),
    ]


# -- spawn ------------------------------------------------------------------------------------
def spawned_sum(scale):
    """Something only this rank can return (its rank, its pid), and the job's sum."""
    total = td.allreduce(torch.tensor([float(td.rank())]) * scale, op="sum").item()
    return td.rank(), os.getpid(), total


def spawned_raise():
    if td.rank() == 1:
        raise KeyError("missing-key")
    td.barrier()


def spawned_die():
    if td.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    td.barrier()


def test_spawn_returns_results_in_rank_order():
    # Each rank returns its own rank: a list in any order but rank order is told apart.
    results = td.spawn(spawned_sum, 2, args=(10.0,))
    assert [(rank, total) for rank, _, total in results] == [(0, 10.0), (1, 10.0)]
    assert len({pid for _, pid, _ in results} | {os.getpid()}) == 3  # two children, not us


def test_spawn_reraises_child_exception_with_rank_and_traceback():
    with pytest.raises(td.errors.SpawnError, match="rank 1 failed") as raised:
        td.spawn(spawned_raise, 2)
    assert raised.value.rank == 1
    assert "KeyError: 'missing-key'" in str(raised.value)
    assert "spawned_raise" in str(raised.value)  # the child's traceback


def test_spawn_reports_a_killed_child():
    with pytest.raises(td.errors.SpawnError, match="killed by SIGKILL") as raised:
        td.spawn(spawned_die, 2)
    assert raised.value.rank == 1


def test_spawn_rejects_zero_processes():
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        td.spawn(spawned_sum, 0)


def test_hosted_store_listens_on_the_given_address_only():
    """A single-node job's rendezvous must not be reachable from other machines."""
    from tandem import rendezvous

    store = rendezvous.host_store("127.0.0.1", 0)
    listening = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(":")
        if int(port, 16) == store.port and state == "0A":  # 0A: LISTEN
            listening.append(address)
    assert listening == ["0100007F"]  # 127.0.0.1, little-endian hex
    del store


TORCHRUN_SCRIPT = """
    import torch, tandem as td
    world = td.init()
    total = td.allreduce(torch.ones(1) * (world.rank + 1), op="sum").item()
    print(f"rank {world.rank} of {world.size} total {total}")
"""


@ahead.plan("test_a_script_started_by_torchrun_joins_its_job")
def _(tmp):
    script = tmp / "train.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return [Command([torchrun, "--nproc-per-node", "2", str(script)], clean, None, 100)]


@pytest.mark.timeout(120)
def test_a_script_started_by_torchrun_joins_its_job(jobs, request):
    """torchrun's variables (and its agent's store) are read: the same script, unchanged."""
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stderr
    # The ranks share torchrun's stdout, so one rank's line may run into the other's.
    assert sorted(re.findall(r"rank \d of \d total [\d.]+", done.stdout)) == [
        "rank 0 of 2 total 3.0", "rank 1 of 2 total 3.0"]
