"""Job discovery, field by field: what each launcher's variables give, and what their absence
gives. Written against the mutants that `scripts/mutation.sh environments` found alive (a
variable renamed, a default changed, a boundary moved); process-free, like
`test_environments.py`, which holds the main cases."""

import re

import pytest

from tandem.job import environments
from tandem.job.environments import (
    JobEnvironment,
    check_half_set,
    detect,
    first_slurm_host,
    rendezvous_address,
    resolve,
    tandem_variables,
)

MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29512"}


def _fields(job: JobEnvironment) -> tuple:
    return (job.source, job.rank, job.size, job.local_rank, job.local_size, job.master_addr,
            job.master_port, job.store_hosted, job.backend, job.under_mpi)


# -- each adapter, with and without its optional variables --------------------------------------

def test_tandem_flags_are_off_unless_set_to_one():
    base = {"TANDEM_RANK": "1", "TANDEM_SIZE": "2", "TANDEM_LOCAL_RANK": "0",
            "TANDEM_LOCAL_SIZE": "1"}
    assert _fields(detect(base)) == ("tandem", 1, 2, 0, 1, None, None, False, None, False)
    on = detect({**base, "TANDEM_STORE_HOSTED": "1", "TANDEM_UNDER_MPI": "1",
                 "TANDEM_BACKEND": "mpi", "TANDEM_MASTER_ADDR": "h", "TANDEM_MASTER_PORT": "7"})
    assert (on.store_hosted, on.under_mpi, on.backend, on.master_addr, on.master_port) == (
        True, True, "mpi", "h", 7)
    off = detect({**base, "TANDEM_STORE_HOSTED": "0", "TANDEM_UNDER_MPI": "0", "TANDEM_BACKEND": ""})
    assert (off.store_hosted, off.under_mpi, off.backend) == (False, False, None)


def test_tandem_variables_write_what_detect_reads():
    written = tandem_variables(rank=0, size=1, local_rank=0, local_size=1, master_addr="a",
                               master_port=1, store_hosted=False)
    assert written["TANDEM_STORE_HOSTED"] == "0" and "TANDEM_UNDER_MPI" not in written
    assert "TANDEM_BACKEND" not in written
    assert detect(written).store_hosted is False
    assert tandem_variables(rank=0, size=1, local_rank=0, local_size=1, master_addr="a",
                            master_port=1, under_mpi=True)["TANDEM_UNDER_MPI"] == "1"


def test_torchrun_defaults_and_its_agent_store():
    bare = detect({"RANK": "2", "WORLD_SIZE": "3"})
    assert _fields(bare) == ("torchrun", 2, 3, 0, 3, "127.0.0.1", None, False, None, False)
    full = detect({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", **MASTER})
    assert _fields(full) == ("torchrun", 2, 4, 1, 2, "10.0.0.1", 29512, True, None, False)
    assert not detect({"RANK": "0", "WORLD_SIZE": "1",
                       "TORCHELASTIC_USE_AGENT_STORE": "False"}).store_hosted


def test_open_mpi_and_mpich_take_the_rendezvous_from_master_variables():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert _fields(detect({**ompi, **MASTER})) == (
        "openmpi", 1, 2, 1, 2, "10.0.0.1", 29512, False, None, True)
    assert (detect(ompi).master_addr, detect(ompi).master_port) == (None, None)
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "4"}
    assert _fields(detect({**mpich, **MASTER})) == (
        "mpich", 1, 4, 0, 4, "10.0.0.1", 29512, False, None, True)
    assert detect({**mpich, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                   "SLURM_NTASKS_PER_NODE": "3"}).local_size == 2  # Hydra's word first


def test_slurm_step_variables_win_and_the_port_comes_from_the_job():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "step[2-3]",
           "SLURM_JOB_NODELIST": "job[1-9]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_ID": "20001"}
    job = detect(env)
    assert _fields(job) == ("slurm", 1, 4, 0, 2, "step2", 20001, False, None, False)
    assert detect({**env, "MASTER_PORT": "4242", "MASTER_ADDR": "m"}).master_port == 4242
    assert detect({**env, "MASTER_ADDR": "m"}).master_addr == "m"
    alone = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (alone.master_addr, alone.master_port, alone.local_size) == ("127.0.0.1", None, 1)
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "39999"}
                  ).master_port == 20000 + 39999 % 20000
    for mpi in ({"PMIX_RANK": "0"},):
        assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", **mpi}).under_mpi
    assert detect({"SLURM_PROCID": "0"}).source == "single"  # both PROCID and NTASKS needed
    assert detect({"SLURM_NTASKS": "2"}).source == "single"


def test_slurm_node_lists():
    assert first_slurm_host("n[7,3-4]") == "n7"
    with pytest.raises(ValueError, match=r"^cannot read the SLURM node list '\[1-2\]'$"):
        first_slurm_host("[1-2]")


def test_a_local_rank_must_be_inside_its_node():
    JobEnvironment("x", 0, 2, local_rank=1, local_size=2)
    JobEnvironment("x", 0, 1, local_rank=0, local_size=0)  # unknown node size: rank 0 only
    with pytest.raises(ValueError, match="^x: local rank 2 is outside a node of 2 processes$"):
        JobEnvironment("x", 0, 4, local_rank=2, local_size=2)
    with pytest.raises(ValueError, match="local rank 1 is outside a node of 0 processes"):
        JobEnvironment("x", 0, 4, local_rank=1, local_size=0)


# -- a rendezvous without a rank ---------------------------------------------------------------

@pytest.mark.parametrize("env, start", [
    ({"MASTER_PORT": "1"}, "MASTER_PORT=1 is set but RANK and WORLD_SIZE are not: "),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0"},
     "MASTER_ADDR=h, MASTER_PORT=1 and RANK=0 are set but WORLD_SIZE is not: "),
])
def test_a_rendezvous_without_a_rank_is_refused_with_the_fix(env, start):
    with pytest.raises(ValueError) as raised:
        check_half_set(env)
    message = str(raised.value)
    assert message.startswith(start), message
    assert "torch.distributed-style job, but nothing says which rank it is. Pass td.init(rank=r, " \
           "world_size=n), or start the script with `tandem run -np N` / torchrun; to run it as " \
           "a single process, unset " in message
    assert detect({}).source == "single" and check_half_set({"OTHER": "1"}) is None


def test_detect_reads_the_process_environment_by_default(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "SLURM_PROCID",
                 "OMPI_COMM_WORLD_RANK", "TANDEM_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect().source == "torchrun" and resolve().rank == 1


# -- ports and init_method ---------------------------------------------------------------------

def test_ports_1_and_65535_are_valid_and_nothing_outside():
    assert rendezvous_address("tcp://h:1", {}) == ("h", 1)
    assert rendezvous_address(None, {"MASTER_ADDR": "h", "MASTER_PORT": "65535"}) == ("h", 65535)
    for port in ("0", "65536", "-1", " "):
        with pytest.raises(ValueError, match=re.escape(
                f"td.init: MASTER_PORT: the rendezvous port must be a number from 1 to 65535 "
                f"(rank 0 listens on it and the others connect to it), got {port!r}")):
            rendezvous_address("env://", {"MASTER_ADDR": "h", "MASTER_PORT": port})


@pytest.mark.parametrize("init_method", ["tcp://h:1/path", "tcp://h:1?x=1", "tcp://h:1#f",
                                         "udp://h:1"])
def test_an_init_method_with_anything_but_host_and_port_is_refused(init_method):
    with pytest.raises(ValueError, match=re.escape(
            f"td.init: cannot join through init_method={init_method!r}; use "
            "init_method='tcp://host:port' (rank 0's address) or 'env://' (MASTER_ADDR/MASTER_PORT)")):
        rendezvous_address(init_method, {})


def test_init_method_errors_name_the_call():
    with pytest.raises(TypeError, match=re.escape(
            "td.init(rank=0, world_size=2, init_method=4000): init_method must be a string; use")):
        resolve(rank=0, world_size=2, init_method=4000, env={})
    with pytest.raises(ValueError, match=re.escape(
            "td.init(init_method='tcp://h:0'): init_method='tcp://h:0': the rendezvous port")):
        resolve(init_method="tcp://h:0", env={})
    with pytest.raises(ValueError, match=re.escape("td.init(rank=0, world_size=2, init_method="
                                                   "'tcp://h:x'): init_method='tcp://h:x': the")):
        resolve(rank=0, world_size=2, init_method="tcp://h:x", env={})
    with pytest.raises(ValueError, match="needs a host and a port"):
        rendezvous_address("tcp://h::4000", {})
    with pytest.raises(ValueError, match=re.escape(
            "td.init needs the address where rank 0 hosts the rendezvous, but MASTER_ADDR and "
            "MASTER_PORT are not set: set MASTER_ADDR and MASTER_PORT in every process's "
            "environment (on one machine, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT), or")):
        rendezvous_address(None, {})


# -- td.init(rank=, world_size=) against a launcher --------------------------------------------

def test_arguments_that_agree_with_a_launcher_join_its_job():
    env = {"RANK": "1", "WORLD_SIZE": "2", **MASTER, "TORCHELASTIC_USE_AGENT_STORE": "true"}
    job = resolve(rank=1, world_size=2, env=env)
    assert _fields(job) == ("torchrun", 1, 2, 0, 2, "10.0.0.1", 29512, True, None, False)
    same_port = resolve(rank=1, world_size=2, init_method="tcp://other:29512", env=env)
    assert same_port.master_addr == "10.0.0.1"  # a host has many names: only the port counts
    assert resolve(rank=1, world_size=2, init_method="env://", env=env).source == "torchrun"


def test_a_different_port_than_the_launchers_is_refused():
    env = {"RANK": "1", "WORLD_SIZE": "2", **MASTER}
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=1, world_size=2, init_method='tcp://h:1'): torchrun already hosts this "
            "job's rendezvous at 10.0.0.1:29512; leave out init_method (the launcher provides "
            "it), or start the script without the launcher")):
        resolve(rank=1, world_size=2, init_method="tcp://h:1", env=env)
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    # No port from the launcher: nothing to disagree with.
    assert resolve(rank=0, world_size=1, init_method="tcp://h:1", env=ompi).source == "openmpi"


def test_a_launcher_disagreement_says_what_to_do():
    env = {"RANK": "0", "WORLD_SIZE": "2", **MASTER}
    with pytest.raises(ValueError) as raised:
        resolve(rank=1, world_size=2, env=env)
    assert str(raised.value) == (
        "td.init(rank=1, world_size=2) disagrees with the environment: RANK=0 and WORLD_SIZE=2 "
        "(set by torchrun) give this process another place in the job. Pass the same values, or "
        "leave out rank= and world_size= and let torchrun say; if this process was not started "
        "by torchrun, unset those variables.")
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=1, world_size=2) disagrees with the environment's WORLD_SIZE=3: pass")):
        resolve(rank=1, world_size=2, env={**MASTER, "WORLD_SIZE": "3"})


def test_rank_arguments_are_checked_exactly():
    assert resolve(rank=1, world_size=2, env={**MASTER, "RANK": "1"}).rank == 1  # a stray RANK that agrees
    assert environments.check_rank_arguments(1, 2) == (1, 2)
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=2, world_size=2): rank 2 is not a rank of a world of 2 processes; ranks "
            "are numbered 0 to 1, one per process")):
        environments.check_rank_arguments(2, 2)
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=1) names rank but not world_size: pass both, td.init(rank=r, "
            "world_size=n), or neither to let the launcher's environment say")):
        environments.check_rank_arguments(1, None)
    with pytest.raises(TypeError, match=re.escape(
            "td.init(rank=0, world_size=2.0): world_size must be an int, got 2.0 (float); convert "
            "it first, e.g. world_size=int(os.environ[...])")):
        environments.check_rank_arguments(0, 2.0)
    with pytest.raises(ValueError, match=re.escape(
            "td.init(rank=1, world_size=2): local rank 2 is outside a node of 2 processes")):
        resolve(rank=1, world_size=2, env={**MASTER, "LOCAL_RANK": "2"})
    job = resolve(rank=0, world_size=1, init_method="tcp://h:5", env={})
    assert (job.source, job.master_addr, job.master_port, job.store_hosted) == (
        "manual", "h", 5, False)


def test_slurm_steps_started_with_pmi_can_initialise_mpi():
    # Under `srun --mpi=pmi2` the MPICH adapter answers first; SLURM's own still says "MPI".
    from tandem.job.environments.adapters import detect_slurm

    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_slurm({**base, "PMI_RANK": "0"}).under_mpi
    assert not detect_slurm(base).under_mpi


def test_a_rendezvous_named_without_a_rank_is_refused():
    with pytest.raises(ValueError) as raised:
        resolve(init_method="tcp://h:4000", env={})
    assert str(raised.value) == (
        "td.init(init_method='tcp://h:4000') names a rendezvous but not this process's rank: "
        "pass td.init(rank=r, world_size=n, init_method=...), or start the script with "
        "`tandem run -np N` / torchrun")
