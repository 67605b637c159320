"""Job discovery: one adapter per launcher, tried in order; no launcher is a world of one."""

import pytest

from tandem.job import environments
from tandem.job.environments import detect, first_slurm_host, tandem_variables


def test_no_launcher_is_a_world_of_one():
    job = detect({})
    assert (job.source, job.rank, job.size, job.local_rank, job.local_size) == ("single", 0, 1, 0, 1)


def test_tandem_variables_round_trip():
    env = tandem_variables(rank=2, size=4, local_rank=0, local_size=2, master_addr="10.0.0.1",
                           master_port=29501, backend="gloo")
    job = detect(env)
    assert (job.source, job.rank, job.size, job.local_rank, job.local_size) == ("tandem", 2, 4, 0, 2)
    assert (job.master_addr, job.master_port, job.store_hosted, job.backend) == (
        "10.0.0.1", 29501, True, "gloo")


def test_an_mpi_rank_of_tandem_run_is_a_tandem_rank_under_mpi():
    """The supervisor of `tandem run`'s MPI ranks gives each the variables of a local rank."""
    from tandem.launch.mpi import rank as mpi_rank

    enclosing = {"TANDEM_RANK": "5", "TANDEM_SIZE": "8", "RANK": "3", "WORLD_SIZE": "4"}
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    base = {**enclosing, **hydra, "TANDEM_LAUNCH_TOKEN": "secret"}
    job = mpi_rank._mpi_job(base)  # MPI's word, not the enclosing job's
    env = mpi_rank._child_environment(job, ("127.0.0.1", 4321), base)
    child = detect(env)
    assert (child.source, child.rank, child.size, child.local_rank, child.local_size) == (
        "tandem", 1, 2, 1, 2)
    assert (child.master_addr, child.master_port, child.store_hosted) == ("127.0.0.1", 4321, True)
    assert (child.backend, child.under_mpi) == ("mpi", True)
    assert "TANDEM_LAUNCH_TOKEN" not in env and env["PMI_RANK"] == "1"  # MPI's own, kept


def test_torchrun():
    job = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "host", "MASTER_PORT": "1234"})
    assert (job.source, job.rank, job.size, job.master_addr, job.master_port) == (
        "torchrun", 1, 2, "host", 1234)
    assert not job.store_hosted


def test_openmpi_and_mpich_mark_mpi():
    ompi = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (ompi.source, ompi.rank, ompi.size, ompi.local_rank, ompi.under_mpi) == (
        "openmpi", 3, 4, 1, True)
    mpich = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                    "MPI_LOCALNRANKS": "2"})
    assert (mpich.source, mpich.rank, mpich.size, mpich.local_rank, mpich.under_mpi) == (
        "mpich", 1, 2, 1, True)


def test_mpich_under_srun_takes_the_local_rank_from_slurm():
    job = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                  "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"})
    assert (job.source, job.rank, job.local_rank, job.local_size, job.under_mpi) == (
        "mpich", 3, 1, 2, True)


def test_slurm_uses_first_host_and_a_job_derived_port():
    job = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "4(x2)",
                  "SLURM_JOB_ID": "12345"})
    assert (job.source, job.rank, job.size, job.local_rank, job.local_size) == ("slurm", 5, 8, 1, 4)
    assert job.master_addr == "gpu07"
    assert job.master_port == 20000 + 12345 % 20000


@pytest.mark.parametrize("nodelist, first", [
    ("node01", "node01"), ("node[03-05,9]", "node03"), ("a1,b2", "a1"), ("gpu[12]", "gpu12"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_tandem_wins_over_the_others():
    env = {**tandem_variables(rank=0, size=1, local_rank=0, local_size=1, master_addr="a",
                              master_port=1), "RANK": "3", "WORLD_SIZE": "4", "PMI_RANK": "2"}
    assert detect(env).source == "tandem"
    assert [a.__name__ for a in environments.ADAPTERS] == [
        "detect_tandem", "detect_torchrun", "detect_openmpi", "detect_mpich", "detect_slurm"]


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside a world of size 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
])
def test_bad_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        detect(env)


# -- td.init(rank=, world_size=, init_method=): torch.distributed's manual template ----------------
MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29512"}


def test_manual_job_from_master_variables():
    job = environments.resolve(rank=1, world_size=3, env=MASTER)
    assert (job.source, job.rank, job.size, job.local_rank, job.local_size) == ("manual", 1, 3, 1, 3)
    assert (job.master_addr, job.master_port, job.store_hosted) == ("10.0.0.1", 29512, False)
    assert job.backend is None and not job.under_mpi


@pytest.mark.parametrize("init_method, env, address", [
    ("tcp://127.0.0.1:4000", {}, ("127.0.0.1", 4000)),
    ("tcp://node07:4000", MASTER, ("node07", 4000)),      # the argument wins over the variables
    ("tcp://[::1]:4000", {}, ("::1", 4000)),
    ("env://", MASTER, ("10.0.0.1", 29512)),
])
def test_manual_job_init_method(init_method, env, address):
    job = environments.resolve(rank=0, world_size=2, init_method=init_method, env=env)
    assert (job.master_addr, job.master_port) == address


def test_manual_job_local_rank_from_local_variables():
    env = {**MASTER, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    job = environments.resolve(rank=3, world_size=4, env=env)
    assert (job.rank, job.size, job.local_rank, job.local_size) == (3, 4, 1, 2)


def test_a_manual_world_of_one_needs_no_rendezvous():
    job = environments.resolve(rank=0, world_size=1, env={})
    assert (job.source, job.size, job.master_port) == ("manual", 1, None)


def test_no_arguments_is_detect():
    assert environments.resolve(env={}).source == "single"
    assert environments.resolve(env={"RANK": "1", "WORLD_SIZE": "2"}).source == "torchrun"


@pytest.mark.parametrize("kwargs, env, error, message", [
    (dict(rank=5, world_size=2), MASTER, ValueError,
     r"td.init\(rank=5, world_size=2\): rank 5 is not a rank of a world of 2 processes; ranks are "
     "numbered 0 to 1"),
    (dict(rank=-1, world_size=2), MASTER, ValueError, "rank -1 is not a rank of a world of 2"),
    (dict(rank=1), MASTER, ValueError, r"td.init\(rank=1\) names rank but not world_size: pass both"),
    (dict(world_size=2), MASTER, ValueError, "names world_size but not rank: pass both"),
    (dict(rank=0, world_size=0), MASTER, ValueError, "world_size must be at least 1"),
    (dict(rank="1", world_size=2), MASTER, TypeError, "rank must be an int, got '1' \\(str\\)"),
    (dict(rank=True, world_size=2), MASTER, TypeError, "rank must be an int, got True"),
    (dict(rank=1, world_size=2), {}, ValueError,
     "MASTER_ADDR and MASTER_PORT are not set: set MASTER_ADDR and MASTER_PORT in every process's "
     "environment .* or pass init_method='tcp://host:port'"),
    (dict(rank=1, world_size=2), {"MASTER_ADDR": "h"}, ValueError,
     "but MASTER_PORT is not set: set MASTER_PORT"),
    (dict(rank=1, world_size=2, init_method="env://"), {"MASTER_PORT": "1"}, ValueError,
     "MASTER_ADDR is not set"),
    (dict(rank=1, world_size=2), {"MASTER_ADDR": "h", "MASTER_PORT": "x"}, ValueError,
     "MASTER_PORT: the rendezvous port must be a number from 1 to 65535 .* got 'x'"),
    (dict(rank=1, world_size=2, init_method="file:///tmp/rdv"), {}, ValueError,
     "cannot join through init_method='file:///tmp/rdv'; use init_method='tcp://host:port'"),
    (dict(rank=1, world_size=2, init_method="tcp://host"), {}, ValueError,
     "init_method='tcp://host' needs a host and a port"),
    (dict(rank=1, world_size=2, init_method="tcp://:4000"), {}, ValueError, "needs a host and a port"),
    (dict(rank=1, world_size=2, init_method="tcp://host:0"), {}, ValueError,
     "port must be a number from 1 to 65535 .* got '0'"),
    (dict(rank=1, world_size=2, init_method="tcp://host:70000"), {}, ValueError, "got '70000'"),
    (dict(rank=0, world_size=1, init_method="127.0.0.1:4000"), {}, ValueError, "cannot join through"),
    (dict(init_method="tcp://host:4000"), {}, ValueError,
     r"names a rendezvous but not this process's rank: pass td.init\(rank=r, world_size=n"),
    (dict(rank=3, world_size=4), {**MASTER, "LOCAL_WORLD_SIZE": "2"}, ValueError,
     "local rank 3 is outside a node of 2 processes; on several nodes set LOCAL_RANK"),
])
def test_bad_manual_arguments_are_named_with_the_fix(kwargs, env, error, message):
    with pytest.raises(error, match=message):
        environments.resolve(env=env, **kwargs)


def _tandem(rank, size):
    return tandem_variables(rank=rank, size=size, local_rank=0, local_size=1, master_addr="a",
                            master_port=1234)


@pytest.mark.parametrize("env, names", [
    (_tandem(0, 1), "TANDEM_RANK=0 and TANDEM_SIZE=1 \\(set by tandem\\)"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 and WORLD_SIZE=2 \\(set by torchrun\\)"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "OMPI_COMM_WORLD_RANK=1 and OMPI_COMM_WORLD_SIZE=3"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_PROCID=0 and SLURM_NTASKS=2 \\(set by slurm\\)"),
])
def test_arguments_that_contradict_a_launcher_name_both(env, names):
    with pytest.raises(ValueError, match=r"td.init\(rank=1, world_size=2\) disagrees with the "
                                         f"environment: {names}"):
        environments.resolve(rank=1, world_size=2, env={**MASTER, **env})


@pytest.mark.parametrize("stray", [{"RANK": "0"}, {"WORLD_SIZE": "3"}])
def test_arguments_that_contradict_a_stray_rank_variable(stray):
    name, value = next(iter(stray.items()))
    with pytest.raises(ValueError, match=f"disagrees with the environment's {name}={value}: "
                                         f"pass the same values, or unset {name}"):
        environments.resolve(rank=1, world_size=2, env={**MASTER, **stray})


def test_arguments_that_agree_with_a_launcher_join_its_job():
    """The launcher's job is joined, with its hosted store and local ranks."""
    job = environments.resolve(rank=1, world_size=2, env=_tandem(1, 2))
    assert (job.source, job.rank, job.size, job.master_port, job.store_hosted) == (
        "tandem", 1, 2, 1234, True)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", **MASTER}
    assert environments.resolve(rank=1, world_size=2, init_method="env://", env=torchrun).source == (
        "torchrun")
    assert environments.resolve(init_method="tcp://other-name:29512", env=torchrun).rank == 1
    assert environments.resolve(rank=1, world_size=2, env={**MASTER, "RANK": "1"}).source == "manual"


def test_an_init_method_that_contradicts_the_launchers_rendezvous():
    with pytest.raises(ValueError, match="tandem already hosts this job's rendezvous at a:1234; "
                                         "leave out init_method"):
        environments.resolve(rank=1, world_size=2, init_method="tcp://a:29512", env=_tandem(1, 2))


# -- an environment that names a rendezvous but no rank ------------------------------------------
@pytest.mark.parametrize("env, message", [
    ({"MASTER_PORT": "29500"}, "MASTER_PORT=29500 is set but RANK and WORLD_SIZE are not"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "29500"},
     "MASTER_ADDR=h and MASTER_PORT=29500 are set but RANK and WORLD_SIZE are not"),
    ({"MASTER_ADDR": "h"}, "MASTER_ADDR=h is set but RANK and WORLD_SIZE are not"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4", "MASTER_PORT": "1"}, "MASTER_PORT=1 and WORLD_SIZE=4 are set but RANK is not"),
])
def test_a_rendezvous_without_a_rank_is_an_error_not_a_world_of_one(env, message):
    with pytest.raises(ValueError, match=message) as raised:
        detect(env)
    assert "td.init(rank=r, world_size=n)" in str(raised.value)
    assert "`tandem run -np N` / torchrun" in str(raised.value)
    with pytest.raises(ValueError, match=message):
        environments.resolve(init_method="env://", env=env)


@pytest.mark.parametrize("env, source", [
    ({}, "single"),
    ({"MASTER_PORT": ""}, "single"),                                           # empty is unset
    ({"LOCAL_RANK": "0"}, "single"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "torchrun"),
    ({**_tandem(0, 2), "MASTER_PORT": "29500"}, "tandem"),                     # tandem run
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h"}, "openmpi"),      # mpiexec
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "29500"}, "mpich"),     # hydra
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_PORT": "29500"}, "slurm"),  # srun
])
def test_launchers_that_set_a_rendezvous_are_read_before_the_check(env, source):
    """Each launcher's ranks still find their job; the check only sees what no adapter claimed."""
    assert detect(env).source == source
