"""The torch.distributed backends "tandem" and "mpi": their creators, and their meeting with `td.init`.

    import tandem
    dist.init_process_group("tandem")   # tandem's engine: MPI under mpiexec / tandem run, else Gloo
    dist.init_process_group("mpi")      # stock pip PyTorch has no MPI; this is tandem's, over mpi4py

`register()` (run once torch.distributed is imported, `torch_hook`) adds "tandem" with
`Backend.register_backend`. "mpi" is a name torch keeps for its own MPI build and never asks a
plug-in about: where torch has no MPI, `register()` sets the two names torch reads for it
(`_MPI_AVAILABLE`, `ProcessGroupMPI`) to tandem's, so `init_process_group("mpi")` creates
tandem's group. It also wraps `init_process_group` (`guarded_init`) for what torch cannot know:
a call after `td.init()` (the same backend: nothing to do; another: an error naming both), and
a "tandem" job started by a launcher torch does not read (mpiexec, SLURM) or by none (a world
of one, said so); a rank of `tandem run` then tells its launcher that it joined. Rank 0's
TCPStore of torch's own rendezvous listens on MASTER_ADDR only, not on every interface
(`rendezvous.torch_rendezvous`).

The engine under a default group is made here (`_engine`), watched like `td.init`'s, or handed
over by `td.init` (`handover`), so both sides use one engine; `default_engine()` lets
`td.init` adopt the one a script made first.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tandem.comm import context
from tandem.comm.engines.backend import Backend
from tandem.comm.torch_pg.process_group import TandemProcessGroup
from tandem.comm.torch_pg.work import UnsupportedOperation
from tandem.job import environments, settings
from tandem.job.environments import JobEnvironment
from tandem.job.environments.adapters import env_int

NAMES = ("tandem", "mpi")
_handed: tuple[Backend, torch.device] | None = None  # td.init's engine, for the next default group
_registered = False


class BackendMismatchError(ValueError):
    """`init_process_group` asked for another backend than the one `td.init()` started."""


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _job(rank: int, size: int) -> JobEnvironment:
    """The job as its launcher describes it, when that is the world torch was given; else a
    job named by torch's arguments alone (the manual template), with no store to report on."""
    found = environments.launched(os.environ)
    if found is not None and (found.rank, found.size) == (rank, size):
        return found
    local = env_int(os.environ, "LOCAL_RANK") if os.environ.get("LOCAL_RANK") else rank
    return JobEnvironment("torch.distributed", rank, size, local, max(size, local + 1))


def _engine_name(job: JobEnvironment) -> str:
    return settings.choose_backend(
        job.backend or settings.current().backend, cuda=torch.cuda.is_available(),
        mpi=importlib.util.find_spec("mpi4py") is not None, mpi_job=job.under_mpi)


def _engine(kind: str, job: JobEnvironment, store: Any, timeout: float) -> Backend:
    """A watched engine for a new default group of `job`: MPI, or Gloo/NCCL on torch's store."""
    from tandem.comm.watchdog.monitor import watch

    if kind == "mpi":
        from tandem.comm.engines.mpi_backend import MPIBackend

        engine: Backend = MPIBackend.create(job, timeout)
        if job.source != "tandem":
            # MPI meets without a store: MASTER_PORT names none (only tandem run hosts one for
            # the watchdog's reports), so the watchdog must not wait to connect to it.
            job = dataclasses.replace(job, master_port=None)
    else:
        from tandem.comm.engines.c10d_engine import C10dEngine

        engine = C10dEngine.create(kind, store, job.rank, job.size, timeout, _device())
    return watch(engine, job, timeout, settings.current().debug)


def _group(engine: Backend, name: str, timeout: float, device: torch.device,
           owned: bool) -> TandemProcessGroup:
    group = TandemProcessGroup(engine, None, name, timeout, device,
                               owner=engine.shutdown if owned else None)
    if owned:
        # A script that never calls destroy_process_group() still leaves the job at exit, as
        # td.init's do: the watchdog tells the peers (a rank still waiting in a collective it
        # skipped is named at once, not at the timeout). Registered after MPI's exit guard, so
        # it runs first; shutdown() is idempotent.
        atexit.register(group.shutdown)
    return group


def _subgroup_refused(name: str) -> UnsupportedOperation:
    return UnsupportedOperation(
        f"new_group(backend={name!r}) under a default group of another backend: tandem's groups "
        f"are made by its default group. Start with init_process_group({name!r}) for the whole "
        "job, or leave backend= out of new_group")


def create_tandem(options: Any, backend_options: Any = None) -> TandemProcessGroup:
    """`Backend.register_backend("tandem", ...)`'s creator (extended API), for a default group."""
    if list(options.global_ranks_in_group):
        raise _subgroup_refused("tandem")
    timeout = options.timeout.total_seconds()
    if _handed is not None:  # td.init made the engine
        engine, device = _handed
        return _group(engine, "tandem", timeout, device, owned=False)
    job = _job(options.group_rank, options.group_size)
    engine = _engine(_engine_name(job), job, options.store, timeout)
    return _group(engine, "tandem", timeout, _device(), owned=True)


class TandemMPI:
    """Stands in for torch's `ProcessGroupMPI`: `create(ranks)` makes the default group."""

    @staticmethod
    def create(ranks: list[int]) -> TandemProcessGroup:
        if ranks:
            raise _subgroup_refused("mpi")
        timeout = settings.current().timeout_s
        job = environments.detect()
        if job.size == 1 and job.source == "single":
            _warn_alone("mpi")
        engine = _engine("mpi", job, None, timeout)
        return _group(engine, "mpi", timeout, _device(), owned=True)


def _warn_alone(name: str) -> None:
    warnings.warn(
        f"init_process_group({name!r}) found no launcher (no tandem run, torchrun, mpiexec or "
        "SLURM variables): this process is a world of one. Start the script with "
        "`tandem run -np N` (or torchrun / mpiexec) to run it on N ranks", stacklevel=4)


def handover(engine: Backend, rank: int, size: int, timeout: float,
             device: torch.device) -> None:
    """Make torch.distributed's default group the engine `td.init` created (its MPI engine)."""
    global _handed
    register()
    _handed = (engine, device)
    hook = sys.excepthook
    try:
        _original_init(backend="tandem", store=dist.HashStore(), rank=rank, world_size=size,
                       timeout=timedelta(seconds=timeout))
    finally:
        _handed = None
        # torch prefixes every traceback line with "[rankN]:" from here on; td.init's
        # tracebacks stay as they were on MPI (tandem run labels each line already).
        sys.excepthook = hook


def default_engine() -> Backend | None:
    """The engine under torch.distributed's default group when that group is tandem's."""
    if not dist.is_initialized():
        return None
    group = c10d._get_default_group()
    return group.engine if isinstance(group, TandemProcessGroup) else None


def default_backend() -> str | None:
    """The name of torch.distributed's default group's backend, or None when there is none."""
    return dist.get_backend() if dist.is_initialized() else None


def _same(asked: str, running: str) -> bool:
    """Whether a call asking for `asked` is served by the default group `td.init` made."""
    if asked in ("undefined", "tandem", running):
        return True  # "tandem": whatever engine td.init chose is tandem's
    engine = default_engine()
    return asked == "mpi" and engine is not None and engine.name == "mpi"


def guarded_init(backend: Any = None, init_method: str | None = None, timeout: Any = None,
                 world_size: int = -1, rank: int = -1, store: Any = None, *rest: Any,
                 **more: Any) -> None:
    """torch's `init_process_group`, aware of `td.init()` and of tandem's launchers."""
    asked = str(c10d.Backend(backend)) if backend is not None else "undefined"
    if context.installed() and dist.is_initialized():
        running = dist.get_backend()
        if _same(asked, running):
            return  # td.init() did it, on this very world
        raise BackendMismatchError(
            f"init_process_group(backend={asked!r}) after td.init(), which already initialised "
            f"torch.distributed with backend {running!r} on the same world. Drop the "
            f"init_process_group call (torch.distributed works as it is), or ask td.init for "
            f"the backend you want before anything else (td.init(backend=...)).")
    if asked in ("tandem", "mpi") and timeout is None:
        # torch's own default is 30 minutes; tandem's waits end at TANDEM_TIMEOUT (300 s)
        timeout = timedelta(seconds=settings.current().timeout_s)
    if asked == "tandem" and store is None and init_method in (None, "env://") \
            and rank == -1 and world_size == -1 and "RANK" not in os.environ:
        job = environments.detect()  # mpiexec, SLURM... or a world of one
        if job.size == 1:
            _warn_alone(asked)
        from tandem.comm.engines.torch_backend import rendezvous_store

        t = timeout.total_seconds() if timeout is not None else settings.current().timeout_s
        store = dist.HashStore() if job.size == 1 or _engine_name(job) == "mpi" \
            else rendezvous_store(job, t)
        rank, world_size = job.rank, job.size
    _original_init(backend, init_method, timeout, world_size, rank, store, *rest, **more)
    _tell_the_launcher()


def _tell_the_launcher() -> None:
    """A rank of `tandem run` that joined a world says so to its launcher's store, whatever the
    backend or port (`rendezvous.torch_rendezvous.report_joined`, `launch/local/joined.py`)."""
    job = environments.detect_tandem(os.environ)
    if job is None or not job.store_key or job.master_port is None or dist.get_world_size() < 2:
        return
    from tandem.rendezvous.torch_rendezvous import report_joined

    report_joined(job.master_addr or "127.0.0.1", job.master_port, job.store_key,
                  dist.get_rank(), dist.get_world_size())
    from tandem.comm.torch_pg.copies import report_at_exit  # a framework that ran it as a copy

    report_at_exit(job.master_addr or "127.0.0.1", job.master_port, job.store_key, dist.get_rank())


# torch's own: under the first-call wrapper of `hooks/torch_backends.py`, which keeps it there.
_original_init = getattr(dist.init_process_group, "tandem_unwrapped", dist.init_process_group)


def _job_store(hostname: str, port: int, timeout: Any) -> dist.Store | None:
    """The launcher's authenticated store, for torch's env:// or tcp:// rendezvous at the
    MASTER_ADDR/MASTER_PORT `tandem run` gave this rank; None for any other address (a
    script's own, or no tandem job: torch's TCPStore as usual)."""
    job = environments.detect_tandem(os.environ)
    if job is None or not job.store_key or not job.store_hosted or job.master_port is None \
            or f"{hostname}:{port}" != os.environ.get("TANDEM_TORCH_RENDEZVOUS"):
        return None
    from tandem.comm.engines.torch_backend import rendezvous_store

    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    store = rendezvous_store(job, seconds)
    # torch keeps the C++ half of a Python store only: its methods are looked up on the Python
    # object, which must outlive every group made on it (the process, here).
    _JOB_STORES.append(store)
    # Keys of their own beside tandem's, per port: a second world after destroy_process_group
    # meets on the same keys torch's own store would have given it.
    return dist.PrefixStore(f"torch-rendezvous/{port}/", store)


_JOB_STORES: list[dist.Store] = []


def is_registered() -> bool:
    """Whether `register()` has run (`init_process_group` is tandem's)."""
    return _registered


def register() -> None:
    """Add "tandem" (and "mpi" where torch has none) to torch.distributed; idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    if "tandem" not in dist.Backend.backend_list:
        dist.Backend.register_backend("tandem", create_tandem, extended_api=True,
                                      devices=["cpu", "cuda"])
    if not dist.is_mpi_available():
        c10d.ProcessGroupMPI = TandemMPI
        c10d._MPI_AVAILABLE = True
    # Rank 0's TCPStore of torch's env:// and tcp:// rendezvous listens on MASTER_ADDR only.
    # (torch.distributed's attribute `rendezvous` is a function: ask for the module by name)
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    from tandem.rendezvous.torch_rendezvous import bound_c10d_store

    bound_c10d_store(torch_rendezvous, dist.TCPStore, _job_store)
    wrapped = functools.wraps(_original_init)(guarded_init)
    dist.init_process_group = wrapped
    c10d.init_process_group = wrapped
