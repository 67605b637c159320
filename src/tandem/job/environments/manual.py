"""A job named in code: `td.init(rank=r, world_size=n, init_method=...)`, checked against the launcher.

torch.distributed's manual template: with no launcher, the arguments describe the job and rank 0
hosts the rendezvous at `init_method` (or MASTER_ADDR/MASTER_PORT); under a launcher they must
agree with what its adapter (`adapters`) found. Every check runs before any message, and every
error names the call, the variables that disagree and the fix.
"""

from __future__ import annotations

import operator
import os
import urllib.parse

from tandem.job.environments.adapters import (
    RANK_PAIR,
    RENDEZVOUS,
    Env,
    JobEnvironment,
    and_list,
    check_half_set,
    env_int,
    launched,
    single_process,
    store_key,
)

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
        missing = [name for name in RENDEZVOUS if not env.get(name)]
        if missing:
            raise ValueError(
                f"{call} needs the address where rank 0 hosts the rendezvous, but "
                f"{and_list(missing)} {'is' if len(missing) == 1 else 'are'} not set: set "
                f"{and_list(missing)} in every process's environment (on one machine, "
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
    settings = and_list([f"{name}={env[name]}" for name in names if name in env])
    if source is None:
        return ValueError(
            f"{call} disagrees with the environment's {settings}: pass the same values, or "
            f"unset {and_list([name for name in names if name in env])}"
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
    for name, value in zip(RANK_PAIR, (rank, world_size), strict=True):
        if name in env and env_int(env, name) != value:
            raise _disagreement(call, (name,), env, None)
    local_rank = env_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else rank
    local_size = env_int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else world_size
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
        store_hosted=False,  # rank 0 hosts the store (comm.engines.torch_backend._make_store)
        store_key=store_key(env),
    )
