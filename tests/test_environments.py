"""Job discovery: one adapter per launcher, tried in order; no launcher is a world of one."""

import pytest

from tandem import environments
from tandem.environments import detect, first_slurm_host, tandem_variables


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
    from tandem.launch import mpi_rank

    enclosing = {"TANDEM_RANK": "5", "TANDEM_SIZE": "8", "RANK": "3", "WORLD_SIZE": "4"}
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    base = {**enclosing, **hydra, "TANDEM_LAUNCH_TOKEN": "secret"}
    job = mpi_rank._mpi_job(environments, base)  # MPI's word, not the enclosing job's
    env = mpi_rank._child_environment(environments, job, ("127.0.0.1", 4321), base)
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
