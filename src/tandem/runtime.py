"""The process's place in the job: `init`, `World` and the global state behind them."""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import time
from dataclasses import dataclass

import torch

from tandem.comm import context
from tandem.comm.engines.backend import Backend
from tandem.job import environments, settings
from tandem.job.environments import JobEnvironment


@dataclass(frozen=True)
class World:
    """Who this process is. `device` is where its tensors should live.

    It unpacks as `rank, device = td.init()`, the pair a training script needs first (the
    `init()` of many course and seed scripts returns it); every field has its name too.

    Made by `td.init`, not by users.

    Args:
        rank: this process's global rank, 0 to `size - 1`.
        size: the number of ranks in the job.
        local_rank: its rank among the ranks on its machine.
        local_size: the number of ranks on its machine.
        device: `cuda:<local rank>` when there are GPUs, else the CPU.
        backend: the engine in use: "gloo", "nccl" or "mpi".
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    backend: str

    def __iter__(self):
        return iter((self.rank, self.device))


@dataclass
class RuntimeState:
    """Everything `init` set up; owned by this module, read by the rest of tandem.

    Installed as comm's context (`tandem.comm.context`): comm reads the backend, timeout,
    checks and debug flags from this very object without importing this module.
    """

    world: World
    backend: Backend
    job: JobEnvironment
    checks: bool
    debug: bool
    timeout: float
    # The engine is the one under a torch.distributed default group the script made first
    # (`init_process_group("tandem")`): torch's to release, not ours.
    adopted: bool = False
    # init made torch.distributed's default group over its engine (MPI): shutdown destroys it.
    torch_group: bool = False


_state: RuntimeState | None = None


def mpi4py_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def choose_backend(requested: str | None, job: JobEnvironment) -> str:
    """The backend to use: asked for, then the launcher's choice (TANDEM_BACKEND), then what
    the machine has, in the order `tandem run` uses too (`settings.choose_backend`)."""
    return settings.choose_backend(
        requested or job.backend or settings.current().backend,
        cuda=torch.cuda.is_available(), mpi=mpi4py_available(), mpi_job=job.under_mpi,
    )


def _device_for(job: JobEnvironment) -> torch.device:
    """`cuda:<local_rank>` when there are GPUs (one per local rank), else the CPU."""
    if torch.cuda.is_available():
        index = job.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _create_backend(name: str, job: JobEnvironment, timeout: float, device: torch.device):
    if name == "mpi":
        from tandem.comm.engines.mpi_backend import MPIBackend

        return MPIBackend.create(job, timeout=timeout)
    from tandem.comm.engines.torch_backend import TorchBackend

    return TorchBackend.create(name, job, timeout=timeout, device=device)


def init(
    backend: str | None = None,
    timeout: float | None = None,
    debug: bool | None = None,
    checks: bool = True,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> World:
    """Join the job this process was started in (a world of one without a launcher).

    The job is read from the launcher's variables (`tandem run`, torchrun, Open MPI, MPICH,
    SLURM). Without a launcher, `rank` and `world_size` join one the way torch.distributed's
    manual template does (`mp.Process(target=run, args=(rank, n))`, then
    `td.init(rank=rank, world_size=n)` in each): rank 0 hosts the rendezvous at
    `init_method="tcp://host:port"`, or, without it or with `"env://"`, at MASTER_ADDR and
    MASTER_PORT, and the other ranks connect to it. `local_rank` is LOCAL_RANK if set, else the
    rank, and `local_size` LOCAL_WORLD_SIZE if set, else `world_size`: one node, like the
    template; set both variables for a job that spans nodes. A world of one needs no
    rendezvous. Under a launcher, `rank`/`world_size` must agree with what it says. The MPI
    backend learns its ranks from mpiexec, so it cannot join a job named this way.

    An environment that names a rendezvous but no rank (MASTER_ADDR or MASTER_PORT without
    RANK/WORLD_SIZE, or only one of those two) is an error, never a silent world of one. Every
    mistake in the arguments or the environment is raised here, before any communication.

    Idempotent: a second call returns the same `World`; asking for a different backend, rank
    or world size then is an error. `timeout` (seconds, default 300 or `TANDEM_TIMEOUT`) bounds
    every wait. `checks=False` or `TANDEM_CHECKS=0` turns off the cross-rank argument checks;
    `debug=True` or `TANDEM_DEBUG=1` turns on per-collective fingerprints.

    Args:
        backend: "gloo", "nccl" or "mpi"; None takes the launcher's (TANDEM_BACKEND), else
            NCCL with GPUs, MPI under mpiexec with mpi4py, else Gloo.
        timeout: seconds any wait may take before it fails naming who waited for whom (None:
            `TANDEM_TIMEOUT`, else 300).
        debug: per-collective fingerprints that name each rank's line on a mismatch (None:
            `TANDEM_DEBUG`).
        checks: compare every collective's arguments across ranks (False: off).
        rank: this process's rank, when no launcher started it (with `world_size`).
        world_size: the number of processes, when no launcher started them (with `rank`).
        init_method: "tcp://host:port" of the rendezvous rank 0 hosts, or "env://" (MASTER_ADDR
            and MASTER_PORT), with `rank`/`world_size`.

    Returns:
        This process's `World` (unpacks as `rank, device`).

    Raises:
        ValueError: a mistake in the arguments or the environment (an unknown backend, NCCL
            without a GPU, a non-positive timeout, a rendezvous named without a rank, `rank`/
            `world_size` that disagree with the launcher, `backend="mpi"` with `rank=`), or a
            second call asking for another backend, rank or world size (call td.shutdown()
            first); each message says the fix.
        TypeError: `rank` or `world_size` is not an int.
        RendezvousError: the rendezvous port is taken, or rank 0's host cannot be reached
            within `timeout`.
        TimeoutError: the other ranks did not all join within `timeout`.
    """
    global _state
    if _state is not None:
        current = _state.world
        if backend is not None and backend.lower() != current.backend:
            raise ValueError(
                f"tandem is already initialised with backend {current.backend!r}; "
                f"init(backend={backend!r}) cannot change it. Call td.shutdown() first."
            )
        asked = {"rank": (rank, current.rank), "world_size": (world_size, current.size)}
        for name, (value, actual) in asked.items():
            if value is not None and value != actual:
                raise ValueError(
                    f"tandem is already initialised as rank {current.rank} of {current.size}; "
                    f"init({name}={value!r}) cannot change it. Call td.shutdown() first."
                )
        return current
    return _start(environments.resolve(rank, world_size, init_method), backend, timeout, debug,
                  checks)


def _start(job: JobEnvironment, backend: str | None, timeout: float | None, debug: bool | None,
           checks: bool) -> World:
    """`init` once the job is known: the engine, its watchdog, the state comm reads."""
    global _state
    told = settings.current()
    if timeout is None:
        timeout = told.timeout_s
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    if job.elastic is not None:
        job = elastic_membership(job, timeout)
    name = choose_backend(backend, job)
    if name == "mpi" and job.source == "manual":
        raise ValueError(
            f"backend 'mpi' cannot join a job named by td.init(rank={job.rank}, "
            f"world_size={job.size}): MPI learns its ranks from its launcher, and mpi4py needs "
            "mpiexec. Start the job with `mpiexec -n N python script.py` or "
            "`tandem run -np N --backend mpi script.py` and call td.init(backend='mpi') without "
            "rank=/world_size=, or use backend='gloo' (or 'nccl' on GPUs)."
        )
    device = _device_for(job)
    debug = told.debug if debug is None else bool(debug)
    from tandem.comm.torch_pg import join as torch_join
    from tandem.comm.watchdog.monitor import watch

    found = torch_join.existing(backend, job, device)  # the script's dist.init_process_group
    adopted = found is not None and found.watched
    if found is not None:
        engine, name = found.engine, found.engine.name
    else:
        engine = _create_backend(name, job, timeout, device)
    if not adopted:
        # Every operation, on every engine, is watched: no wait outlives the timeout unexplained.
        engine = watch(engine, job, timeout, debug)
    # torch.distributed on the same world: Gloo and NCCL made it above; MPI gets tandem's group.
    torch_group = found is None and name == "mpi"
    if torch_group:
        torch_join.handover(engine, job.rank, job.size, timeout, device)
    world = World(job.rank, job.size, job.local_rank, job.local_size, device, name)
    # Leave the job cleanly even when the script never calls shutdown() (engines that are
    # torn down by interpreter exit instead can abort with a C++ error).
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    _state = RuntimeState(
        world=world,
        backend=engine,
        job=job,
        checks=told.checks if checks is True else bool(checks),
        debug=debug,
        timeout=float(timeout),
        adopted=adopted,
        torch_group=torch_group,
    )
    context.install(_state)  # comm reads the engine from here, never from this module
    return world


def joins_running_job() -> bool:
    """Whether this process was started to join an elastic job already running (a newcomer,
    `tandem.elastic`): the collectives of its set-up meet nobody, and are skipped."""
    elastic = state().job.elastic
    return elastic is not None and elastic.newcomer


def elastic_membership(job: JobEnvironment, timeout: float) -> JobEnvironment:
    """`job` as the elastic job's current round places it: the launcher may have replaced the
    round this process was started for (a rank failed, others joined) before it got here."""
    from tandem import rendezvous
    from tandem.rendezvous import elastic_rounds

    store = rendezvous.StoreClient(job.master_addr or "127.0.0.1", job.master_port, job.store_key,
                                   timeout)
    try:
        joined, rank = elastic_rounds.settle(store, job.elastic.worker,
                                             time.monotonic() + timeout)
    finally:
        store.close()
    return dataclasses.replace(job, rank=rank, size=joined.size, local_rank=rank,
                               local_size=joined.size,
                               elastic=dataclasses.replace(job.elastic, round=joined.number))


def rejoin() -> World:
    """Leave this world and join the elastic job's current round with the same backend,
    timeout and checks (`tandem.elastic`): this process may get another rank in a world of
    another size. Collective over the round's members."""
    current = state()
    if current.job.elastic is None:
        raise RuntimeError("td.rejoin: this job is not elastic (tandem run --min-np/--max-np)")
    current.backend.abort()  # peers still waiting on this rank in the old world fail now
    shutdown()
    return _start(current.job, current.world.backend, current.timeout, current.debug,
                  current.checks)


def shrinks() -> bool:
    """Whether this job goes on without a rank that fails: an MPI world that `tandem run
    --backend mpi --min-np A` started under Open MPI's fault tolerance (ULFM), where
    `td.elastic.run` calls `shrink` when a collective fails with a lost rank."""
    current = state()
    return current.world.backend == "mpi" and settings.current().mpi_on_failure == "shrink"


def shrink() -> tuple[int, ...]:
    """After a rank of this MPI world failed: put this process on the world of the ranks
    alive (`MPIBackend.shrink`: ULFM's revoke and shrink), and build again what `init` built
    over the engine: the watchdog, torch.distributed's default group, the state comm reads.
    The survivors keep their order (the new rank of each is its place among them), their
    device, timeout and checks. Collective over the survivors.

    Returns:
        The ranks lost, as they were numbered in the world before.

    Raises:
        RuntimeError: the engine cannot shrink (only MPI's can, under `tandem run --backend mpi
            --min-np`).
        TimeoutError: a rank that has not failed did not take part within the timeout.
    """
    global _state
    current = state()
    watched = current.backend
    engine = getattr(watched, "inner", watched)
    if not hasattr(engine, "shrink"):
        raise RuntimeError(f"td.elastic: the {current.world.backend} engine cannot shrink its "
                           "world; an elastic job on it restarts its ranks in the launcher's "
                           "next round instead")
    from tandem.comm.torch_pg import join as torch_join
    from tandem.comm.watchdog.monitor import watch

    shrunk = engine.shrink()
    if watched is not engine:
        watched.watchdog.stop()
    if current.torch_group:
        torch_join.release(watched)
    job = dataclasses.replace(current.job, rank=shrunk.rank, size=shrunk.size,
                              local_rank=shrunk.rank, local_size=shrunk.size)
    backend = watch(shrunk, job, current.timeout, current.debug)
    if current.torch_group:
        torch_join.handover(backend, job.rank, job.size, current.timeout, current.world.device)
    world = dataclasses.replace(current.world, rank=job.rank, size=job.size,
                                local_rank=job.rank, local_size=job.size)
    _state = dataclasses.replace(current, world=world, backend=backend, job=job)
    context.install(_state)
    return tuple(sorted(set(range(current.world.size)) - set(shrunk.previous)))


def is_initialized() -> bool:
    """Whether `td.init()` has joined this process to a job (and `td.shutdown()` not yet left it).

    Returns:
        True between `td.init()` and `td.shutdown()`.

    Raises:
        Nothing: safe to call at any time.
    """
    return _state is not None


def state() -> RuntimeState:
    """The runtime state; a clear error when `init` has not been called."""
    if _state is None:
        raise RuntimeError("tandem is not initialised: call td.init() first")
    return _state


def get_backend() -> Backend:
    return state().backend


def world() -> World:
    return state().world


def rank() -> int:
    """This process's rank in the job, 0 to `td.size() - 1`.

    Returns:
        The global rank.

    Raises:
        RuntimeError: `td.init()` has not been called (or `td.shutdown()` was).
    """
    return state().world.rank


def size() -> int:
    """The number of ranks (processes) in the job.

    Returns:
        The world size.

    Raises:
        RuntimeError: `td.init()` has not been called (or `td.shutdown()` was).
    """
    return state().world.size


def local_rank() -> int:
    """This process's rank among the ranks on its machine (its GPU index under one rank per GPU).

    Returns:
        The local rank, 0 to `td.local_size() - 1`.

    Raises:
        RuntimeError: `td.init()` has not been called (or `td.shutdown()` was).
    """
    return state().world.local_rank


def local_size() -> int:
    """The number of ranks on this machine.

    Returns:
        The local world size.

    Raises:
        RuntimeError: `td.init()` has not been called (or `td.shutdown()` was).
    """
    return state().world.local_size


def device() -> torch.device:
    """The device this rank computes on: its GPU (`cuda:<local rank>`) when it has one, else the CPU.

    Returns:
        A `torch.device` to move the model and batches to.

    Raises:
        RuntimeError: `td.init()` has not been called (or `td.shutdown()` was).
    """
    return state().world.device


def shutdown() -> None:
    """Leave the job and release the backend. Safe to call when not initialised.

    Raises:
        Nothing: a second call, or one without `td.init`, returns at once.
    """
    global _state
    if _state is None:
        return
    current, _state = _state, None
    context.clear()
    if current.torch_group:
        from tandem.comm.torch_pg import join as torch_join

        torch_join.release(current.backend)  # torch's default group over it goes first
    if not current.adopted:
        current.backend.shutdown()
