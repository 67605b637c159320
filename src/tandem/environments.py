"""Where a job learns who it is: one small adapter per launcher.

Each adapter reads the variables its launcher sets and returns a `JobEnvironment`, or None when
the process was not started that way. They are tried in a fixed order (`ADAPTERS`): tandem's
own launcher first, then torchrun, Open MPI, MPICH/Hydra and SLURM; with none of them the job is
a world of one, so `python train.py` just works, unless the environment names a rendezvous but
no rank (MASTER_PORT without RANK, say): that is an error (`check_half_set`), never a silent world
of one. `resolve` adds what `td.init(rank=, world_size=, init_method=)` says: torch.distributed's
manual template, a job no launcher describes. This module is the only place in tandem that reads
job-discovery variables.
"""

from __future__ import annotations

import operator
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass


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


def _int(env: Env, name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int(env: Env, *names: str, default: int) -> int:
    """The first of `names` that is set, as an integer."""
    for name in names:
        if env.get(name):
            return _int(env, name)
    return default


def _port(env: Env, name: str) -> int | None:
    return _int(env, name) if env.get(name) else None


def detect_tandem(env: Env) -> JobEnvironment | None:
    """Variables set by `tandem run` (see `tandem.launch`); under MPI by each rank's supervisor,
    with TANDEM_UNDER_MPI=1 (launch/mpi_rank.py)."""
    if "TANDEM_RANK" not in env:
        return None
    return JobEnvironment(
        source="tandem",
        rank=_int(env, "TANDEM_RANK"),
        size=_int(env, "TANDEM_SIZE"),
        local_rank=_int(env, "TANDEM_LOCAL_RANK"),
        local_size=_int(env, "TANDEM_LOCAL_SIZE"),
        master_addr=env.get("TANDEM_MASTER_ADDR"),
        master_port=_port(env, "TANDEM_MASTER_PORT"),
        store_hosted=env.get("TANDEM_STORE_HOSTED", "0") == "1",
        backend=env.get("TANDEM_BACKEND") or None,
        under_mpi=env.get("TANDEM_UNDER_MPI", "0") == "1",
    )


def detect_torchrun(env: Env) -> JobEnvironment | None:
    """torchrun / torch.distributed.run (also any launcher that sets the same variables)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    size = _int(env, "WORLD_SIZE")
    return JobEnvironment(
        source="torchrun",
        rank=_int(env, "RANK"),
        size=size,
        local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
        local_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(env, "MASTER_PORT"),
        # torchrun's elastic agent hosts the store and says so.
        store_hosted=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def detect_openmpi(env: Env) -> JobEnvironment | None:
    """Open MPI's mpirun / mpiexec."""
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return JobEnvironment(
        source="openmpi",
        rank=_int(env, "OMPI_COMM_WORLD_RANK"),
        size=_int(env, "OMPI_COMM_WORLD_SIZE"),
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_port(env, "MASTER_PORT"),
        under_mpi=True,
    )


def detect_mpich(env: Env) -> JobEnvironment | None:
    """MPICH's Hydra (mpiexec), also Intel MPI and MVAPICH which share it."""
    if "PMI_RANK" not in env:
        return None
    size = _int(env, "PMI_SIZE")
    # Hydra says where a rank sits on its node; under `srun --mpi=pmi2` only SLURM does.
    local_rank = _first_int(env, "MPI_LOCALRANKID", "SLURM_LOCALID", default=0)
    local_size = _first_int(env, "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", default=size)
    return JobEnvironment(
        source="mpich",
        rank=_int(env, "PMI_RANK"),
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        master_addr=env.get("MASTER_ADDR"),
        master_port=_port(env, "MASTER_PORT"),
        under_mpi=True,
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
    size = _int(env, "SLURM_NTASKS")
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
        rank=_int(env, "SLURM_PROCID"),
        size=size,
        local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_size=local_size,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=port,
        # srun with --mpi=pmi2/pmix sets PMI variables too; MPI can then initialise.
        under_mpi="PMI_RANK" in env or "PMIX_RANK" in env,
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


# The variables the rendezvous-style launchers (torchrun and its imitators) set.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
_RANK_PAIR = ("RANK", "WORLD_SIZE")


def _and(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def check_half_set(env: Env) -> None:
    """Refuse an environment that names a rendezvous but no rank (for use after the adapters).

    MASTER_ADDR/MASTER_PORT, or one of RANK/WORLD_SIZE, mean someone meant this process to join
    a job; running it as a world of one would train N independent models and say nothing.
    """
    found = [name for name in _RENDEZVOUS if env.get(name)]
    found += [name for name in _RANK_PAIR if name in env]
    missing = [name for name in _RANK_PAIR if name not in env]
    if not found or not missing:
        return  # nothing set, or RANK and WORLD_SIZE both set (torchrun's adapter reads those)
    settings = _and([f"{name}={env[name]}" for name in found])
    raise ValueError(
        f"{settings} {'is' if len(found) == 1 else 'are'} set but {_and(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not: this process was meant to join a "
        "torch.distributed-style job, but nothing says which rank it is. Pass "
        "td.init(rank=r, world_size=n), or start the script with `tandem run -np N` / torchrun; "
        f"to run it as a single process, unset {_and(found)}."
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


# -- a job named in code: td.init(rank=r, world_size=n, init_method=...) --------------------------
# Each launcher's names for "which rank of how many", to name them in a disagreement.
_RANK_VARIABLES = {
    "tandem": ("TANDEM_RANK", "TANDEM_SIZE"),
    "torchrun": ("RANK", "WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS"),
}


def _call(rank: object, world_size: object, init_method: str | None = None) -> str:
    given = [f"{name}={value!r}" for name, value in
             (("rank", rank), ("world_size", world_size), ("init_method", init_method))
             if value is not None]
    return f"td.init({', '.join(given)})"


def _as_int(name: str, value: object, call: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{call}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{call}: {name} must be an int, got {value!r} ({type(value).__name__}); "
            f"convert it first, e.g. {name}=int(os.environ[...])"
        ) from None


def check_rank_arguments(rank: object, world_size: object) -> tuple[int, int]:
    """`rank` and `world_size` as given to `td.init`: both or neither, and a rank of the world."""
    call = _call(rank, world_size)
    if (rank is None) != (world_size is None):
        given, other = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise ValueError(
            f"{call} names {given} but not {other}: pass both, td.init(rank=r, world_size=n), "
            "or neither to let the launcher's environment say"
        )
    rank, world_size = _as_int("rank", rank, call), _as_int("world_size", world_size, call)
    if world_size < 1:
        raise ValueError(f"{call}: world_size must be at least 1 (the number of processes)")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{call}: rank {rank} is not a rank of a world of {world_size} processes; ranks are "
            f"numbered 0 to {world_size - 1}, one per process"
        )
    return rank, world_size


def _valid_port(text: str, where: str) -> int:
    """A rendezvous port: a number from 1 to 65535 (0, "any free port", cannot be agreed on)."""
    port = int(text) if text.strip().isdigit() else -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{where}: the rendezvous port must be a number from 1 to 65535 (rank 0 listens on "
            f"it and the others connect to it), got {text!r}"
        )
    return port


def rendezvous_address(init_method: str | None, env: Env, call: str = "td.init") -> tuple[str, int]:
    """Where rank 0 hosts the rendezvous: `tcp://host:port`, or MASTER_ADDR/MASTER_PORT for
    `env://` and for no init_method at all."""
    if init_method is None or init_method == "env://":
        missing = [name for name in _RENDEZVOUS if not env.get(name)]
        if missing:
            raise ValueError(
                f"{call} needs the address where rank 0 hosts the rendezvous, but "
                f"{_and(missing)} {'is' if len(missing) == 1 else 'are'} not set: set "
                f"{_and(missing)} in every process's environment (on one machine, "
                "MASTER_ADDR=127.0.0.1 and a free MASTER_PORT), or pass "
                "init_method='tcp://host:port'"
            )
        return env["MASTER_ADDR"], _valid_port(env["MASTER_PORT"], f"{call}: MASTER_PORT")
    usage = "use init_method='tcp://host:port' (rank 0's address) or 'env://' (MASTER_ADDR/MASTER_PORT)"
    if not isinstance(init_method, str):
        raise TypeError(f"{call}: init_method must be a string; {usage}")
    parts = urllib.parse.urlsplit(init_method)
    if parts.scheme != "tcp" or parts.path or parts.query or parts.fragment:
        raise ValueError(f"{call}: cannot join through init_method={init_method!r}; {usage}")
    host, colon, port = parts.netloc.rpartition(":")
    if not parts.hostname or not colon or host.endswith(":"):
        raise ValueError(f"{call}: init_method={init_method!r} needs a host and a port; {usage}")
    return parts.hostname, _valid_port(port, f"{call}: init_method={init_method!r}")


def _disagreement(call: str, names: tuple[str, ...], env: Env, source: str | None) -> ValueError:
    settings = _and([f"{name}={env[name]}" for name in names if name in env])
    if source is None:
        return ValueError(
            f"{call} disagrees with the environment's {settings}: pass the same values, or "
            f"unset {_and([name for name in names if name in env])}"
        )
    return ValueError(
        f"{call} disagrees with the environment: {settings} (set by {source}) give this process "
        "another place in the job. Pass the same values, or leave out rank= and world_size= and "
        f"let {source} say; if this process was not started by {source}, unset those variables."
    )


def resolve(
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    env: Env | None = None,
) -> JobEnvironment:
    """The job, from `td.init`'s arguments and the environment; checked before any message.

    Without arguments, `detect`. With `rank`/`world_size` and no launcher, a "manual" job:
    rank 0 hosts the rendezvous at `init_method` (or MASTER_ADDR/MASTER_PORT), local_rank is
    LOCAL_RANK or else the rank, local_size LOCAL_WORLD_SIZE or else world_size (one node). Under
    a launcher the arguments must agree with it, and the launcher's job (its store, its local
    ranks) is the one joined.
    """
    env = os.environ if env is None else env
    call = _call(rank, world_size, init_method)
    named = rank is not None or world_size is not None
    if named:
        rank, world_size = check_rank_arguments(rank, world_size)
    elif init_method is not None and init_method != "env://":
        rendezvous_address(init_method, env, call)  # a malformed init_method is an error anyway
    found = launched(env)
    if found is not None:
        if named and (found.rank, found.size) != (rank, world_size):
            raise _disagreement(call, _RANK_VARIABLES.get(found.source, ()), env, found.source)
        if init_method not in (None, "env://") and found.master_port is not None:
            # Ports only: a host has many names, but a different port is a different rendezvous.
            _, port = rendezvous_address(init_method, env, call)
            if port != found.master_port:
                raise ValueError(
                    f"{call}: {found.source} already hosts this job's rendezvous at "
                    f"{found.master_addr}:{found.master_port}; leave out init_method (the "
                    "launcher provides it), or start the script without the launcher"
                )
        return found
    if not named:
        check_half_set(env)
        if init_method is not None:
            raise ValueError(
                f"{call} names a rendezvous but not this process's rank: pass "
                "td.init(rank=r, world_size=n, init_method=...), or start the script with "
                "`tandem run -np N` / torchrun"
            )
        return single_process(env)
    # No launcher, but a stray RANK or WORLD_SIZE (only one of them, or torchrun would have
    # matched) must not contradict the arguments either.
    for name, value in zip(_RANK_PAIR, (rank, world_size), strict=True):
        if name in env and _int(env, name) != value:
            raise _disagreement(call, (name,), env, None)
    local_rank = _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else rank
    local_size = _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else world_size
    if not 0 <= local_rank < local_size:
        raise ValueError(
            f"{call}: local rank {local_rank} is outside a node of {local_size} processes; on "
            "several nodes set LOCAL_RANK and LOCAL_WORLD_SIZE for each process"
        )
    master_addr, master_port = None, None
    if world_size > 1 or init_method is not None:
        master_addr, master_port = rendezvous_address(init_method, env, call)
    return JobEnvironment(
        source="manual", rank=rank, size=world_size, local_rank=local_rank,
        local_size=local_size, master_addr=master_addr, master_port=master_port,
        store_hosted=False,  # rank 0 hosts the store (comm.torch_backend._make_store)
    )


def setting(name: str, default: str | None = None, env: Env | None = None) -> str | None:
    """The raw text of `TANDEM_<name>`; parsed settings are `tandem.settings.current()`.

    Kept for the callers in comm/ and diagnostics/ that still read their setting here; each
    has its parsed field in `settings.Settings` to move to.
    """
    env = os.environ if env is None else env
    return env.get(f"TANDEM_{name}", default)


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
    return variables
