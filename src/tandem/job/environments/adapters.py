"""Where a job learns who it is from its launcher: one small adapter per launcher.

Each adapter reads the variables its launcher sets and returns a `JobEnvironment`, or None when
the process was not started that way. They are tried in a fixed order (`ADAPTERS`): tandem's
own launcher first, then torchrun, Open MPI, MPICH/Hydra and SLURM; with none of them the job is
a world of one, so `python train.py` just works, unless the environment names a rendezvous but
no rank (MASTER_PORT without RANK, say): that is an error (`check_half_set`), never a silent world
of one. Also here: `setting` (a `TANDEM_*` value) and `tandem_variables` (what a tandem launcher
sets for a rank, the inverse of `detect_tandem`).

Standard library only and no tandem import: `launch/mpi/rank.py` loads this file by path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ElasticPlace:
    """Where a process of an elastic job stands: see `tandem.elastic`."""

    round: int
    worker: int
    min_np: int
    max_np: int
    started_in: int = 0  # the round the launcher started this process for; -1: a later one

    @property
    def newcomer(self) -> bool:
        """Started to join a running job: the others do not build the model with it, so its
        construction must not wait for them."""
        return self.started_in < 0


def meeting_tag(job: JobEnvironment, restart: int, generation: int) -> str:
    """The store keys one rendezvous of `job` uses (the engine's, the watchdog's): an elastic
    round's own, which survivors and newcomers share; else the attempt's (`--max-restarts`) and
    this process's init count (a shutdown then init on one store never meets the old keys)."""
    if job.elastic is not None:
        return f"elastic/{job.elastic.round}"
    return f"{restart}/{generation}"


@dataclass(frozen=True)
class JobEnvironment:
    """What a process knows about its job before any communication."""

    source: str  # which launcher started us: "tandem", "torchrun", "openmpi", "mpich", ...
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str | None = None
    master_port: int | None = None
    # True when a launcher (tandem's agent, torchrun's agent) already hosts the rendezvous
    # store at master_addr:master_port, so rank 0 connects to it rather than creating it.
    store_hosted: bool = False
    # The backend the launcher asked for (`tandem run --backend`), if any.
    backend: str | None = None
    # Started by an MPI launcher, so MPI_Init will find its peers.
    under_mpi: bool = False
    # The key of tandem's authenticated rendezvous store (its launcher made it); None: the
    # store is torch's TCPStore (torchrun's agent, or rank 0 where no launcher hosts one).
    store_key: str | None = field(default=None, repr=False)
    # An elastic job (`tandem run --min-np A --max-np B`): the round of membership this process
    # joins (every resize is a new round), its worker id (its own for the life of the process,
    # whatever rank it has) and the range of world sizes. None otherwise.
    elastic: ElasticPlace | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"{self.source}: world size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"{self.source}: rank {self.rank} is outside a world of size {self.size}"
            )
        if not 0 <= self.local_rank < max(self.local_size, 1):
            raise ValueError(
                f"{self.source}: local rank {self.local_rank} is outside a node of "
                f"{self.local_size} processes"
            )


Env = Mapping[str, str]


def env_int(env: Env, name: str) -> int:
    """The variable `name` as an integer; a ValueError naming it if it is not one."""
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int(env: Env, *names: str, default: int) -> int:
    """The first of `names` that is set, as an integer."""
    for name in names:
        if env.get(name):
            return env_int(env, name)
    return default


def _port(env: Env, name: str) -> int | None:
    return env_int(env, name) if env.get(name) else None


def detect_tandem(env: Env) -> JobEnvironment | None:
    """Variables set by `tandem run` (see `tandem.launch`); under MPI by each rank's supervisor,
    with TANDEM_UNDER_MPI=1 (launch/mpi/rank.py)."""
    if "TANDEM_RANK" not in env:
        return None
    return JobEnvironment(
        source="tandem",
        rank=env_int(env, "TANDEM_RANK"),
        size=env_int(env, "TANDEM_SIZE"),
        local_rank=env_int(env, "TANDEM_LOCAL_RANK"),
        local_size=env_int(env, "TANDEM_LOCAL_SIZE"),
        master_addr=env.get("TANDEM_MASTER_ADDR"),
        master_port=_port(env, "TANDEM_MASTER_PORT"),
        store_hosted=env.get("TANDEM_STORE_HOSTED", "0") == "1",
        backend=env.get("TANDEM_BACKEND") or None,
        under_mpi=env.get("TANDEM_UNDER_MPI", "0") == "1",
        store_key=store_key(env),
        elastic=_elastic_place(env),
    )


def _elastic_place(env: Env) -> ElasticPlace | None:
    if "TANDEM_ELASTIC_ROUND" not in env:
        return None
    low, _, high = env.get("TANDEM_ELASTIC_RANGE", "1:1").partition(":")
    started_in = env_int(env, "TANDEM_ELASTIC_ROUND")
    return ElasticPlace(started_in, env_int(env, "TANDEM_ELASTIC_WORKER"), int(low), int(high),
                        started_in)


def store_key(env: Env) -> str | None:
    """The rendezvous store's key: `tandem run` sets it; for jobs that rank 0 hosts (SLURM,
    torchrun without its agent's store, the manual template) the user may give every rank the
    same one, and the store is then tandem's authenticated one instead of torch's TCPStore."""
    return env.get("TANDEM_STORE_KEY") or None


def detect_torchrun(env: Env) -> JobEnvironment | None:
    """torchrun / torch.distributed.run (also any launcher that sets the same variables)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    size = env_int(env, "WORLD_SIZE")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return JobEnvironment(
        source="torchrun",
        rank=env_int(env, "RANK"),
        size=size,
        local_rank=env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
        local_size=env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(env, "MASTER_PORT"),
        # torchrun's elastic agent hosts the store (a TCPStore: no key) and says so.
        store_hosted=agent_store,
        store_key=None if agent_store else store_key(env),
    )


def detect_openmpi(env: Env) -> JobEnvironment | None:
    """Open MPI's mpirun / mpiexec."""
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return JobEnvironment(
        source="openmpi",
        rank=env_int(env, "OMPI_COMM_WORLD_RANK"),
        size=env_int(env, "OMPI_COMM_WORLD_SIZE"),
        local_rank=env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size=env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_port(env, "MASTER_PORT"),
        under_mpi=True,
        store_key=store_key(env),
    )


def detect_mpich(env: Env) -> JobEnvironment | None:
    """MPICH's Hydra (mpiexec), also Intel MPI and MVAPICH which share it."""
    if "PMI_RANK" not in env:
        return None
    size = env_int(env, "PMI_SIZE")
    # Hydra says where a rank sits on its node; under `srun --mpi=pmi2` only SLURM does.
    local_rank = _first_int(env, "MPI_LOCALRANKID", "SLURM_LOCALID", default=0)
    local_size = _first_int(env, "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", default=size)
    return JobEnvironment(
        source="mpich",
        rank=env_int(env, "PMI_RANK"),
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        master_addr=env.get("MASTER_ADDR"),
        master_port=_port(env, "MASTER_PORT"),
        under_mpi=True,
        store_key=store_key(env),
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `node[03-05,9],gpu1` -> `node03`."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_slurm(env: Env) -> JobEnvironment | None:
    """`srun` (and sbatch steps); the first host of the node list is the rendezvous."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    size = env_int(env, "SLURM_NTASKS")
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = size
    if tasks_per_node:
        # "4(x2)" or "2,1": the count for this node is the first number; good enough for
        # the homogeneous layouts SLURM jobs almost always use.
        local_size = int(re.match(r"\d+", tasks_per_node).group(0))
    port = _port(env, "MASTER_PORT")
    if port is None and env.get("SLURM_JOB_ID"):
        # Derive a port from the job id so concurrent jobs sharing a node do not collide.
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    return JobEnvironment(
        source="slurm",
        rank=env_int(env, "SLURM_PROCID"),
        size=size,
        local_rank=env_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_size=local_size,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=port,
        # srun with --mpi=pmi2/pmix sets PMI variables too; MPI can then initialise.
        under_mpi="PMI_RANK" in env or "PMIX_RANK" in env,
        store_key=store_key(env),
    )


def single_process(env: Env) -> JobEnvironment:
    """No launcher: a world of one."""
    return JobEnvironment(source="single", rank=0, size=1, local_rank=0, local_size=1)


ADAPTERS: tuple[Callable[[Env], JobEnvironment | None], ...] = (
    detect_tandem,
    detect_torchrun,
    detect_openmpi,
    detect_mpich,
    detect_slurm,
)


def launched(env: Env) -> JobEnvironment | None:
    """The job as the first adapter that recognises `env` describes it; None without a launcher."""
    for adapter in ADAPTERS:
        found = adapter(env)
        if found is not None:
            return found
    return None


def job_id(source: str, env: Env) -> str | None:
    """The launcher's name for this job, the same on every rank and every restart of it (tandem
    run's and torchrun's run id, SLURM's job and step, Open MPI's PMIx namespace); None when the
    launcher (`source`, a `JobEnvironment.source`) gives none."""
    if source in ("tandem", "torchrun"):
        return env.get("TORCHELASTIC_RUN_ID") or None
    if source == "slurm" and env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    if source == "openmpi":
        return env.get("PMIX_NAMESPACE") or None
    return None


#: The variables the rendezvous-style launchers (torchrun and its imitators) set.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
RANK_PAIR = ("RANK", "WORLD_SIZE")


def and_list(names: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`: names in an error message."""
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def check_half_set(env: Env) -> None:
    """Refuse an environment that names a rendezvous but no rank (for use after the adapters).

    MASTER_ADDR/MASTER_PORT, or one of RANK/WORLD_SIZE, mean someone meant this process to join
    a job; running it as a world of one would train N independent models and say nothing.
    """
    found = [name for name in RENDEZVOUS if env.get(name)]
    found += [name for name in RANK_PAIR if name in env]
    missing = [name for name in RANK_PAIR if name not in env]
    if not found or not missing:
        return  # nothing set, or RANK and WORLD_SIZE both set (torchrun's adapter reads those)
    settings = and_list([f"{name}={env[name]}" for name in found])
    raise ValueError(
        f"{settings} {'is' if len(found) == 1 else 'are'} set but {and_list(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not: this process was meant to join a "
        "torch.distributed-style job, but nothing says which rank it is. Pass "
        "td.init(rank=r, world_size=n), or start the script with `tandem run -np N` / torchrun; "
        f"to run it as a single process, unset {and_list(found)}."
    )


def detect(env: Env | None = None) -> JobEnvironment:
    """The job this process belongs to, from the first adapter that recognises `env`.

    Without a launcher it is a world of one, unless `check_half_set` finds a rendezvous
    without a rank.
    """
    env = os.environ if env is None else env
    found = launched(env)
    if found is not None:
        return found
    check_half_set(env)
    return single_process(env)


def tandem_variables(
    *,
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    master_addr: str,
    master_port: int,
    store_hosted: bool = True,
    backend: str | None = None,
    under_mpi: bool = False,
    store_key: str | None = None,
) -> dict[str, str]:
    """The variables a tandem launcher sets for one rank: the inverse of `detect_tandem`."""
    variables = {
        "TANDEM_RANK": str(rank),
        "TANDEM_SIZE": str(size),
        "TANDEM_LOCAL_RANK": str(local_rank),
        "TANDEM_LOCAL_SIZE": str(local_size),
        "TANDEM_MASTER_ADDR": master_addr,
        "TANDEM_MASTER_PORT": str(master_port),
        "TANDEM_STORE_HOSTED": "1" if store_hosted else "0",
    }
    if backend:
        variables["TANDEM_BACKEND"] = backend
    if under_mpi:
        variables["TANDEM_UNDER_MPI"] = "1"
    if store_key:
        variables["TANDEM_STORE_KEY"] = store_key
    return variables


def torchrun_variables(*, rank: int, size: int, local_rank: int, local_size: int, node: int,
                       nodes: int, master_addr: str, master_port: int, run_id: str,
                       restart: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """What torchrun's agent gives each worker, so that an unchanged torchrun script runs under
    `tandem run` (`tandem run` sets these too; `detect_tandem` still wins for `td.init`).

    torch's `env://` rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    TORCHELASTIC_USE_AGENT_STORE; `dist.is_torchelastic_launched()` reads TORCHELASTIC_RUN_ID;
    Lightning and Accelerate read the rest. MASTER_PORT is a port of its own, never the port of
    tandem's store: that one speaks tandem's authenticated protocol, which a TCPStore client
    cannot. A rank with tandem imported (every rank of `tandem run`, through its sitecustomize)
    meets the others at MASTER_ADDR:MASTER_PORT on the launcher's store instead, under a prefix
    of its own, and nothing listens there (`comm/torch_pg/register._job_store`);
    TANDEM_TORCH_RENDEZVOUS says which address that is, should the script change MASTER_PORT.
    """
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TANDEM_TORCH_RENDEZVOUS": f"{master_addr}:{master_port}",
    }


def horovod_variables(*, rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    """What horovodrun tells each rank, for scripts that read it (`tandem run` sets these too)."""
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
    }
