"""`tandem run` as a torchrun: every rank gets torchrun's variables, so an unchanged torchrun
script runs under it; a job that no rank joined is named at its end.

The jobs are real (`python -m tandem run`, `torchrun`); the variables and options are also
checked without processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs_ahead import Ahead, Command

from tandem.job.environments import detect, detect_torchrun
from tandem.launch import LaunchConfig, LaunchError, config_from_args
from tandem.launch.local.joined import listening
from tandem.launch.local.ranks import Placement, rank_environment

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
JOB_TIMEOUT_S = 150


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(command: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=_env(**extra), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


# --- the variables, without processes ------------------------------------------------------


def test_every_rank_gets_torchruns_variables_with_a_port_of_its_own():
    config = LaunchConfig(np=3, program="t.py", max_restarts=2)
    placement = Placement.single(3, 1234, "the-key")
    env = rank_environment(config, 2, placement, {})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    # torch's TCPStore gets a port of its own: never tandem's (authenticated) store
    assert env["MASTER_PORT"] == str(placement.torch_port) != env["TANDEM_MASTER_PORT"]
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCHELASTIC_RUN_ID"].startswith("tandem-")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "2")
    assert "the-key" not in {v for k, v in env.items() if not k.startswith("TANDEM_")}
    # td.init still reads tandem's own variables first; torchrun's describe the same rank
    assert detect(env).source == "tandem"
    torchrun = detect_torchrun(env)
    assert (torchrun.rank, torchrun.size, torchrun.local_rank) == (2, 3, 2)


def test_an_mpi_rank_gets_torchruns_variables_from_mpi():
    from tandem.launch.mpi import rank as mpi_rank

    base = {"RANK": "7", "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2"}
    env = mpi_rank._child_environment(mpi_rank._mpi_job(base), ("127.0.0.1", 4321), base,
                                      torch_port=5555, run_id="tandem-x")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"],
            env["TORCHELASTIC_RUN_ID"]) == ("1", "2", "1", "5555", "tandem-x")


def test_require_join_comes_from_the_flag_or_its_variable():
    from tandem.cli.command import build_parser

    def config(*argv: str, environ=None) -> LaunchConfig:
        args = build_parser().parse_args(["run", *argv])
        return config_from_args(args, environ or {})

    assert not config("-np", "2", "t.py").require_join
    assert config("-np", "2", "--require-join", "t.py").require_join
    assert config("-np", "2", "t.py", environ={"TANDEM_REQUIRE_JOIN": "1"}).require_join
    with pytest.raises(LaunchError, match="TANDEM_REQUIRE_JOIN='maybe': 'maybe' is not a yes/no"):
        config("-np", "2", "t.py", environ={"TANDEM_REQUIRE_JOIN": "maybe"})


def test_a_listening_port_is_seen():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        assert listening(server.getsockname()[1])
    with socket.socket() as unbound:
        unbound.bind(("127.0.0.1", 0))  # bound, not listening
        assert not listening(unbound.getsockname()[1])


# --- jobs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_parameters(tmp_path_factory) -> dict[str, torch.Tensor]:
    """What `torchrun --nproc-per-node 2` trains: the reference."""
    out = tmp_path_factory.mktemp("torchrun") / "params.pt"
    done = _run([str(TORCHRUN), "--nproc-per-node", "2", str(SCRIPTS / "torchrun_ddp.py"),
                 "gloo", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out)


# Each job below is started side by side with the others, ahead of its test
# (tests/jobs_ahead.py): every test is about what a fresh job does, so each keeps its own.
ahead = Ahead()
jobs = ahead.fixture()


def _command(argv: list[str], **extra: str) -> Command:
    return Command(argv, _env(**extra), ROOT, JOB_TIMEOUT_S)


def _tandem_run(*args: str, **extra: str) -> Command:
    return _command([sys.executable, "-m", "tandem", "run", *args], **extra)


@ahead.plan("test_an_unchanged_torchrun_ddp_script_trains_as_under_torchrun")
def _(tmp, flags):
    if flags[1] == "mpi" and not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", *flags, "--require-join", str(SCRIPTS / "torchrun_ddp.py"),
                        "gloo", str(tmp / "params.pt"))]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("flags", [("--backend", "gloo"), ("--backend", "mpi"),
                                   ("--max-restarts", "1"), ("-H", "localhost:2")],
                         ids=["gloo", "mpi", "restarts", "hosts"])
def test_an_unchanged_torchrun_ddp_script_trains_as_under_torchrun(flags, jobs, request,
                                                                  torchrun_parameters):
    """Every kind of job: the local agent, mpiexec's ranks, and the coordinator's (restarts, -H)."""
    if flags[1] == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    [done], tmp = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0] rank 0 of 2 on gloo done" in done.stdout
    assert "[1] rank 1 of 2 on gloo done" in done.stdout
    mine = torch.load(tmp / "params.pt")
    assert mine.keys() == torchrun_parameters.keys()
    for name, value in torchrun_parameters.items():
        assert torch.equal(mine[name], value), name


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_the_torchrun_script_on_two_agents_trains_as_under_torchrun(torchrun_parameters,
                                                                    tmp_path):
    """One agent per node (`--nnodes 2`, here both on this machine): GROUP_RANK and the ranks'
    numbering come from node 0's placement, MASTER_PORT from node 0's machine."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "params.pt"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(node),
         "--master", f"127.0.0.1:{port}", "--secret", "s3cret", "-np", "1", "--require-join",
         str(SCRIPTS / "torchrun_ddp.py"), "gloo", str(out)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    results = []
    try:
        for agent in agents:
            results.append(agent.communicate(timeout=JOB_TIMEOUT_S))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
    assert [agent.returncode for agent in agents] == [0, 0], results
    assert "[0] rank 0 of 2 on gloo done" in results[0][0], results
    assert "[1] rank 1 of 2 on gloo done" in results[1][0], results
    mine = torch.load(out)
    assert mine.keys() == torchrun_parameters.keys()
    for name, value in torchrun_parameters.items():
        assert torch.equal(mine[name], value), name


ALONE = "import sys\nprint('alone', sys.argv[1:])\n"


@ahead.plan("test_a_job_no_rank_joined_is_named_at_its_end")
def _(tmp, launch):
    if launch == "mpi" and not HAVE_MPI:
        return []
    script = tmp / "alone.py"
    script.write_text(ALONE)
    return [_tandem_run("-np", "2", "--backend", launch, str(script), "x"),
            _tandem_run("-np", "2", "--backend", launch, str(script), "x",
                        TANDEM_REQUIRE_JOIN="1"),
            # one process is no copy of anything
            _tandem_run("-np", "1", "--backend", launch, "--require-join", str(script))]


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch", ["gloo", "mpi"])
def test_a_job_no_rank_joined_is_named_at_its_end(launch, jobs, request):
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    (done, strict, single), tmp = jobs.take(request.node)
    script = tmp / "alone.py"
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0] alone ['x']" in done.stdout and "[1] alone ['x']" in done.stdout
    assert (f"tandem run: warning: 2 independent copies of {script} x ran: no rank joined the "
            "job") in done.stderr, done.stderr
    assert "--require-join" in done.stderr
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert f"tandem run: error: 2 independent copies of {script} x ran" in strict.stderr
    assert single.returncode == 0 and "independent" not in single.stderr, single.stderr


@ahead.plan("test_td_init_on_mpi_joins_even_without_the_watchdog")
def _(tmp):
    if not HAVE_MPI:
        return []
    return [_tandem_run("-np", "2", "--backend", "mpi", "--require-join",
                        str(SCRIPTS / "launch_env.py"), TANDEM_WATCHDOG="0")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_td_init_on_mpi_joins_even_without_the_watchdog(jobs, request):
    """MPI needs no store; td.init still tells the agent that it joined."""
    if not HAVE_MPI:
        pytest.skip("needs mpi4py")
    [done], _ = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "independent" not in done.stderr


@ahead.plan("test_the_ddp_script_on_tandems_backends_trains_as_torchrun_on_gloo")
def _(tmp, launch, backend):
    if launch == "mpi" and not HAVE_MPI:
        return []
    script = [str(SCRIPTS / "torchrun_ddp.py"), backend, str(tmp / "params.pt")]
    if launch == "torchrun":
        return [_command([str(TORCHRUN), "--nproc-per-node", "2", *script])]
    return [_tandem_run("-np", "2", "--backend", launch, "--require-join", *script)]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch, backend", [("mpi", "mpi"), ("mpi", "tandem"),
                                             ("gloo", "tandem"), ("torchrun", "tandem")])
def test_the_ddp_script_on_tandems_backends_trains_as_torchrun_on_gloo(launch, backend, jobs,
                                                                       request,
                                                                       torchrun_parameters):
    """The same script with init_process_group("tandem" | "mpi"): MPI under tandem run, Gloo's
    objects under tandem run --backend gloo and under torchrun itself."""
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    [done], tmp = jobs.take(request.node)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rank 1 of 2 on {backend} done" in done.stdout
    mine = torch.load(tmp / "params.pt")
    for name, value in torchrun_parameters.items():
        assert torch.allclose(mine[name], value, rtol=0, atol=1e-6), name
