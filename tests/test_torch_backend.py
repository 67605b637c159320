"""tandem as a torch.distributed backend ("tandem", and "mpi" on stock pip PyTorch): every
collective, torch's DDP / FSDP2 / DTensor equal to one process, the watchdog on torch's own
calls, `td.init()` and `init_process_group` on one world, and each bad input.

In the shared MPI worlds of the harness, `td.init()` has made torch's default group tandem's
(so these tests also check that `td.init()` initialises torch.distributed on MPI). Jobs cover
what a world cannot: `init_process_group` itself, the Gloo engine, plain mpiexec, faults.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch_backend_checks as checks
from jobs_ahead import Ahead, Command

from tandem.testing import mpiexec_command, run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
JOB_TIMEOUT_S = 150
TOLERANCE = 1e-5

needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="the MPI engine needs mpi4py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TANDEM_", "PMI_", "OMPI_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # torch's renamed collectives
    env.update(extra)
    return env


# --- in the harness's MPI worlds (td.init() made the group) ----------------------------------


def every_call_after_td_init() -> str:
    import torch.distributed as dist

    import tandem as td

    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (
        td.rank(), td.size())
    return checks.check_every_call()


@needs_mpi
@pytest.mark.parametrize("size", [2, 3])
def test_every_torch_call_on_the_mpi_engine(size):
    assert run_distributed(every_call_after_td_init, size, backend="mpi") == ["tandem"] * size


@needs_mpi
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("train", [checks.train_ddp, checks.train_fsdp2, checks.train_dtensor,
                                   checks.train_pipeline],
                         ids=["ddp", "fsdp2", "dtensor", "pipelining"])
def test_torch_parallelism_on_mpi_equals_one_process(train, size):
    differences = run_distributed(train, size, backend="mpi")
    assert max(differences) <= TOLERANCE, differences


def refusals() -> list[str]:
    import torch
    import torch.distributed as dist

    from tandem.comm.torch_pg.register import BackendMismatchError
    from tandem.comm.torch_pg.work import UnsupportedOperation

    said = []
    for call in (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG),
                 lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
                 lambda: dist.recv(torch.ones(2)),
                 lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))):
        try:
            call()
        except UnsupportedOperation as error:
            said.append(str(error))
        else:
            raise AssertionError("accepted")
    dist.init_process_group("mpi")  # after td.init(), on MPI: the same engine, nothing to do
    dist.init_process_group()
    try:
        dist.init_process_group("gloo")
    except BackendMismatchError as error:
        said.append(str(error))
    dist.barrier()  # nothing above communicated: every rank is still in step
    return said


@needs_mpi
def test_what_the_backend_does_not_do_is_named_with_the_alternative():
    said = run_distributed(refusals, 2, backend="mpi")[0]
    assert "all_reduce with ReduceOp.AVG on torch.int64" in said[0] and "ReduceOp.SUM" in said[0]
    assert "ReduceOp.BAND on torch.float32" in said[1] and "integer" in said[1]
    assert "recv without src" in said[2] and "src=" in said[2]
    assert "PREMUL_SUM" in said[3] and "ReduceOp.SUM" in said[3]
    assert said[4].startswith("init_process_group(backend='gloo') after td.init(), which already "
                              "initialised torch.distributed with backend 'tandem'"), said[4]


# --- jobs ------------------------------------------------------------------------------------
# Each test below is about a fresh job or interpreter (init_process_group itself, the Gloo
# engine, plain mpiexec, a rank that diverges, the import order), so each keeps its own
# processes; they run side by side ahead of their tests (tests/jobs_ahead.py).

ahead = Ahead()
jobs = ahead.fixture()


def _command(argv: list[str], timeout: float = JOB_TIMEOUT_S, **extra: str) -> Command:
    return Command(argv, _env(**extra), ROOT, timeout)


def _tandem_run(*args: str, **extra: str) -> Command:
    return _command([sys.executable, "-m", "tandem", "run", *args], **extra)


def _python_command(code: str, **extra: str) -> Command:
    return _command([sys.executable, "-c", code], **extra)


@ahead.plan("test_every_torch_call_on_the_gloo_engine")
def _(tmp):
    return [_tandem_run("-np", "3", "--backend", "gloo", str(SCRIPTS / "torch_calls.py"), "tandem")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_every_torch_call_on_the_gloo_engine(jobs, request):
    """`init_process_group("tandem")` outside MPI: Gloo's own objects under the watchdog."""
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(3):
        assert f"[{rank}] rank {rank}: every call checked on tandem" in done.stdout


@ahead.plan("test_backend_mpi_under_plain_mpiexec")
def _(tmp):
    if not HAVE_MPI:
        return []
    return [_command([*mpiexec_command(2), sys.executable, str(SCRIPTS / "torch_calls.py"), "mpi"])]


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_backend_mpi_under_plain_mpiexec(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0: every call checked on mpi" in done.stdout
    assert "rank 1: every call checked on mpi" in done.stdout


@ahead.plan("test_the_tutorials_programs_run_on_backend_mpi")
def _(tmp, launch):
    if not HAVE_MPI:
        return []
    script = str(SCRIPTS / "tutorial_mpi.py")
    return [_tandem_run("-np", "2", script) if launch == "tandem"
            else _command([*mpiexec_command(2), sys.executable, script])]


@needs_mpi
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch", ["tandem", "mpiexec"])
def test_the_tutorials_programs_run_on_backend_mpi(launch, jobs, request):
    """Ping, all_reduce on a new group, gradients averaged with dist.all_reduce(param.grad.data,
    op=SUM), and the tutorial's Process template with backend='mpi', as written."""
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    # (plain mpiexec interleaves the ranks' prints word by word: count, don't match lines)
    out = done.stdout
    assert out.count("tensor(1.)") == out.count("tensor(2.)") == 2, out
    assert out.count("replicas agree:") == 2, out


@ahead.plan("test_td_init_joins_the_group_the_script_made")
def _(tmp, launch, name):
    if launch == "mpi" and not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", "--backend", launch, str(SCRIPTS / "torch_then_td.py"), name,
                        "x")]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch, name", [("mpi", "tandem"), ("mpi", "mpi"), ("gloo", "tandem"),
                                          ("gloo", "gloo")])
def test_td_init_joins_the_group_the_script_made(launch, name, jobs, request):
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("needs mpi4py")
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"td=3 torch=2 engine={launch} group={name}" in done.stdout


@ahead.plan("test_td_init_asked_for_another_backend_than_the_scripts_group_is_named")
def _(tmp):
    if not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", str(SCRIPTS / "torch_then_td.py"), "tandem", "mismatch")]


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_td_init_asked_for_another_backend_than_the_scripts_group_is_named(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("refused: td.init(backend='gloo'): torch.distributed is already initialised with "
            "backend 'tandem' (tandem's engine: 'mpi')") in done.stdout


@ahead.plan("test_after_td_init_torch_libraries_find_the_job")
def _(tmp, launch):
    if launch == "mpi" and not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", "--backend", launch, str(SCRIPTS / "td_then_torch.py"))]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch", ["mpi", "gloo"])
def test_after_td_init_torch_libraries_find_the_job(launch, jobs, request):
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("needs mpi4py")
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"[0] sampler=[0, 2, 4, 6, 8] torch_sum=2 backend={launch}" in done.stdout
    assert f"[1] sampler=[1, 3, 5, 7, 9] torch_sum=2 backend={launch}" in done.stdout
    other = "nccl" if launch == "gloo" else "gloo"
    running = "gloo" if launch == "gloo" else "tandem"
    assert (f"refused: init_process_group(backend='{other}') after td.init(), which already "
            f"initialised torch.distributed with backend '{running}'") in done.stdout


@ahead.plan("test_a_rank_that_skips_an_all_reduce_is_named_not_waited_for")
def _(tmp, ending):
    if not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", str(SCRIPTS / "torch_skip.py"), "tandem", "last", ending,
                        TANDEM_TIMEOUT="120")]


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("ending", ["destroy", "no-destroy"])
def test_a_rank_that_skips_an_all_reduce_is_named_not_waited_for(ending, jobs, request):
    """torch alone waits 30 minutes; tandem's watchdog names both ranks within seconds (the
    report is the desync's, not the timeout's: TANDEM_TIMEOUT is far away), also when the
    script never calls destroy_process_group() (the rank leaves the job at exit)."""
    [done], _ = jobs.take(request.node)
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout + done.stderr
    assert "tandem watchdog: desync: a rank waits for a peer that has left the job" in text, text
    assert "rank 0: allreduce #" in text and "rank 1: left the job" in text
    assert "tandem watchdog: ending the job from rank 0: desync among ranks 0, 1" in text


@ahead.plan("test_a_rank_that_skips_an_all_reduce_and_trains_on_is_named")
def _(tmp):
    if not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", str(SCRIPTS / "torch_skip.py"), "tandem", "mid",
                        TANDEM_TIMEOUT="120")]


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_rank_that_skips_an_all_reduce_and_trains_on_is_named(jobs, request):
    """Rank 0's checked all_reduce meets the agreement rank 1's next DDP backward sends before
    its first bucket: both ranks' operations are named, and the job ends at once."""
    [done], _ = jobs.take(request.node)
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout + done.stderr
    assert "DivergedError: ranks are in different operations" in text, text
    assert "rank 1: torch DDP gradient reduction #4 after 4 training forwards" in text, text
    assert "tandem run: job failed: rank" in text, text  # both raise: either may exit first


@ahead.plan("test_a_skipped_all_reduce_on_gloo_stops_the_job")
def _(tmp):
    return [_tandem_run("-np", "2", "--backend", "gloo", str(SCRIPTS / "torch_skip.py"), "tandem",
                        "mid", TANDEM_TIMEOUT="120")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_skipped_all_reduce_on_gloo_stops_the_job(jobs, request):
    """On tandem's Gloo engine rank 0's checked all_reduce meets rank 1's agreement of its next
    backward (DDP's, sent before its first bucket): both ranks' operations are named."""
    [done], _ = jobs.take(request.node)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "tandem run: job failed: rank" in done.stderr
    text = done.stdout + done.stderr
    assert "DivergedError: ranks are in different operations" in text, text
    assert "rank 0: all_reduce(shape=(), dtype=float32, op='sum')" in text, text
    assert "rank 1: torch DDP gradient reduction #4 after 4 training forwards" in text, text


MISMATCHES = {
    "shape": ("t = torch.ones(2 + rank); dist.all_reduce(t)",
              ["rank 0: all_reduce(shape=(2,), dtype=float32, op='sum')",
               "rank 1: all_reduce(shape=(3,), dtype=float32, op='sum')"]),
    "op": ("t = torch.ones(2); dist.all_reduce(t, op=dist.ReduceOp.MAX if rank else "
           "dist.ReduceOp.AVG)",
           ["rank 0: all_reduce(shape=(2,), dtype=float32, op='avg')",
            "rank 1: all_reduce(shape=(2,), dtype=float32, op='max')"]),
    "root": ("t = torch.ones(2); dist.broadcast(t, src=rank)",
             ["rank 0: broadcast(shape=(2,), dtype=float32, root=0)",
              "rank 1: broadcast(shape=(2,), dtype=float32, root=1)"]),
    "gather": ("dist.all_gather_into_tensor(torch.zeros(2 * (rank + 1)), torch.ones(rank + 1))",
               ["rank 0: all_gather_into_tensor(shape=(1,), dtype=float32)",
                "rank 1: all_gather_into_tensor(shape=(2,), dtype=float32)"]),
}


@ahead.plan("test_torch_calls_with_different_arguments_are_named_never_garbage")
def _(tmp, engine):
    if engine == "mpi" and not HAVE_MPI:
        return []
    *caught, last = MISMATCHES
    lines = ["import pathlib, torch, torch.distributed as dist, tandem",
             "dist.init_process_group('tandem')",
             "rank = dist.get_rank()",
             f"out = pathlib.Path({str(tmp)!r})"]
    for case in caught:
        lines += ["try:",
                  f"    {MISMATCHES[case][0]}",
                  f"    print('sent {case}', flush=True)",
                  "except tandem.CollectiveMismatchError as error:",
                  f"    (out / f'{case}.{{rank}}.txt').write_text(f'{{type(error).__name__}}: {{error}}')"]
    lines += [MISMATCHES[last][0], f"print('sent {last}', flush=True)"]
    script = tmp / "mismatches.py"
    script.write_text("\n".join(lines) + "\n")
    return [_tandem_run("-np", "2", "--backend", engine, str(script), TANDEM_TIMEOUT="60")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_torch_calls_with_different_arguments_are_named_never_garbage(engine, jobs, request):
    """dist.* calls from a script are user-facing collectives: checked before they send (MPI
    would otherwise sum a 2-element tensor with a 3-element one, or a float32 with a float64,
    and every rank would print garbage with rc 0).

    One job per engine makes every mismatch in turn: each but the last is caught and its
    message written to a file per case and rank (nothing was sent, so the job goes on to the
    next); the last is left to end the job, as in a user's script."""
    if engine == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI engine needs mpi4py")
    *caught, last = MISMATCHES
    [done], tmp_path = jobs.take(request.node)
    text = done.stdout + done.stderr
    assert "sent" not in done.stdout, text
    header = ("CollectiveMismatchError: ranks called a collective with different arguments "
              "(nothing was sent)")
    assert done.returncode == 1, (last, text)
    assert header in text, (last, text)
    for line in MISMATCHES[last][1]:
        assert line in text, (last, line, text)
    for case in caught:
        for rank in range(2):
            path = tmp_path / f"{case}.{rank}.txt"
            assert path.exists(), (case, rank, "no CollectiveMismatchError was raised", text)
            said = path.read_text()
            assert said.startswith(header), (case, rank, said)
            for line in MISMATCHES[case][1]:
                assert line in said, (case, rank, line, said)


# --- bad input, one process ------------------------------------------------------------------


@ahead.plan("test_backend_tandem_without_a_launcher_is_a_world_of_one_said_so")
def _(tmp):
    return [_python_command("import torch.distributed as dist, tandem\n"
                            "dist.init_process_group('tandem')\n"
                            "print('world', dist.get_world_size(), dist.get_backend())\n"
                            "dist.destroy_process_group()\n"),
            # a rendezvous without a rank is someone's half-made job: an error, never a world
            # of one
            _python_command("import torch.distributed as dist, tandem\n"
                            "dist.init_process_group('tandem')\n", MASTER_PORT="29999")]


def test_backend_tandem_without_a_launcher_is_a_world_of_one_said_so(jobs, request):
    (done, half), _ = jobs.take(request.node)
    assert done.returncode == 0, done.stderr
    assert "world 1 tandem" in done.stdout
    assert "init_process_group('tandem') found no launcher" in done.stderr
    assert "tandem run -np N" in done.stderr
    assert half.returncode != 0
    assert "MASTER_PORT=29999 is set but RANK and WORLD_SIZE are not" in half.stderr, half.stderr


@ahead.plan("test_backend_mpi_without_mpi4py_names_the_install_command")
def _(tmp):
    return [_python_command("import sys; sys.modules['mpi4py'] = None\n"
                            "import torch.distributed as dist, tandem\n"
                            "dist.init_process_group('mpi')\n")]


def test_backend_mpi_without_mpi4py_names_the_install_command(jobs, request):
    [done], _ = jobs.take(request.node)
    assert done.returncode != 0
    assert "backend 'mpi' needs mpi4py" in done.stderr
    assert "pip install mpi4py mpich" in done.stderr


IMPORT_ORDERS = ("import tandem, torch", "import torch, tandem")


@ahead.plan("test_import_tandem_registers_the_backends_before_and_after_torch")
def _(tmp):
    codes = [(f"{order}\nimport torch.distributed as dist\n"
              "print('tandem' in dist.Backend.backend_list, dist.is_mpi_available())\n")
             for order in IMPORT_ORDERS]
    return [_python_command(code, **extra) for code in codes
            for extra in ({}, {"OMPI_COMM_WORLD_SIZE": "1"})]


def test_import_tandem_registers_the_backends_before_and_after_torch(jobs, request):
    """"tandem" at once; "mpi" at once where an MPI launcher started the process, else when a
    group asks for it (so dist.is_mpi_available() is no lie to a framework choosing a backend)."""
    results, _ = jobs.take(request.node)
    for order, done, launched in zip(IMPORT_ORDERS, results[::2], results[1::2], strict=True):
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", "False"], (order, done.stdout)
        assert launched.stdout.split() == ["True", "True"], (order, launched.stdout)


# --- td.gather / td.scatter: tandem's own, on the engines' native operations -------------------


def gather_and_scatter() -> list:
    import torch

    import tandem as td

    rank, size = td.rank(), td.size()
    mine = torch.full((2, 3), float(rank))
    gathered = td.gather(mine, root=size - 1)
    if rank == size - 1:
        assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(size)]))
    else:
        assert gathered is None
    whole = torch.arange(size * 2.0).reshape(size, 2) if rank == 0 else torch.zeros(size, 2)
    part = td.scatter(whole, root=0, async_op=True).wait()
    assert torch.equal(part, torch.tensor([[2.0 * rank, 2.0 * rank + 1]])), part
    try:
        td.scatter(torch.zeros(size + 1, 2))
    except ValueError as error:
        return [str(error)]
    raise AssertionError("an uneven scatter was accepted")


@pytest.mark.parametrize("backend, size", [("gloo", 3), pytest.param("mpi", 2, marks=needs_mpi)])
def test_td_gather_and_scatter(backend, size):
    said = run_distributed(gather_and_scatter, size, backend=backend)[0]
    assert said[0] == (f"scatter needs dim 0 divisible by the group size {size}; got shape "
                       f"({size + 1}, 2). Pad the tensor, or use broadcast")
