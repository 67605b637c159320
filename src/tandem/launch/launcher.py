"""`launch(config)`: decide the backend, pick the front end that runs a `LaunchConfig`, and
check what it needs.

Without `--backend` (or TANDEM_BACKEND) the backend is `default_backend(config)`, the one
choice the ranks make too (`settings.choose_backend`): NCCL with GPUs, else MPI when it can run
this job, else Gloo. MPI jobs go to `mpiexec.launch`; Gloo and NCCL jobs to the rank
supervisor (`supervisor.LocalJob`), or, with `--max-restarts`, `--nnodes` or remote hosts
(`-H node1:4`), to `multinode.launch`. Nothing here imports torch: the machine is probed
without it (`cuda_available`), and the rendezvous store is hosted once the ranks are started.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import sys

from tandem.job import settings
from tandem.launch.config import LaunchConfig, LaunchError, check_program
from tandem.launch.local.supervisor import LocalJob
from tandem.launch.mpi import mpiexec, shm


def cuda_available() -> bool:
    """Whether the ranks will see a GPU, asking torch only when the machine has an NVIDIA one."""
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/proc/driver/nvidia/gpus/*"):
        return False  # no NVIDIA device: no need to load torch to know
    import torch  # a GPU is there; is this torch built for it?

    return torch.cuda.is_available()


def mpi_usable() -> bool:
    """mpi4py is importable and an `mpiexec` can be found to start the ranks."""
    if importlib.util.find_spec("mpi4py") is None:
        return False
    try:
        mpiexec.find_mpiexec()
    except LaunchError:
        return False
    return True


def default_backend(config: LaunchConfig, cuda: bool | None = None, mpi: bool | None = None) -> str:
    """The backend of a job that names none: `nccl` with GPUs, else `mpi`, else `gloo`.

    MPI is the faster CPU engine (benchmarks/allreduce.py: 5-66x Gloo's bus bandwidth up to
    16 MB here; 1.46x on the data-parallel MLP), so it is chosen whenever it can run the job:
    mpi4py and an `mpiexec` are installed, and the job is one local agent without restarts.
    `tandem run --backend mpi` does not yet do restarts, `--nnodes` or `-H/--hostfile`
    (mpiexec.launch), so those jobs run on Gloo. `cuda` and `mpi` override the probes (tests).
    """
    local_only = (not config.hosts and config.nnodes == 1 and config.max_restarts == 0
                  and not config.elastic)
    return settings.choose_backend(
        None,
        cuda=cuda_available() if cuda is None else cuda,
        mpi=local_only and (mpi_usable() if mpi is None else mpi),
        mpi_job=local_only,
    )


def with_backend(config: LaunchConfig) -> LaunchConfig:
    """`config` with its backend decided: --backend, else TANDEM_BACKEND, else the default."""
    if config.backend is not None:
        return config
    try:
        named = settings.current().backend
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return dataclasses.replace(config, backend=named or default_backend(config))


def launch(config: LaunchConfig) -> int:
    """Run the job `config` describes; return its exit code (0, or the first failing rank's)."""
    # Decided here, once, and handed to every rank as TANDEM_BACKEND: td.init() then agrees
    # with the front end that started the ranks (mpiexec or not).
    config = with_backend(config)
    if config.master is not None and config.nnodes == 1 and not config.hosts \
            and not (config.max_restarts and config.backend != "mpi"):
        raise LaunchError(
            "--master {}:{} is for jobs of several nodes (--nnodes N) or with restarts: a "
            "1-node job hosts its rendezvous on 127.0.0.1 at a free port itself. Drop --master "
            "(or unset TANDEM_MASTER)".format(*config.master))
    check_program(config)
    # What a killed `tandem run` could not remove (a job that ends removes its own).
    removed, size = shm.remove_stale()
    if removed:
        print(f"tandem run: {shm.describe_removed(removed, size)}", file=sys.stderr, flush=True)
    if config.elastic:
        from tandem.launch.agents import elastic, elastic_hosts  # a world that shrinks and grows

        return elastic_hosts.launch_hosts(config) if config.hosts else elastic.launch(config)
    if config.backend == "mpi":
        return mpiexec.launch(config)
    if config.max_restarts or config.nnodes > 1 or config.remote_hosts:
        from tandem.launch.agents import multinode  # restarts, several agents, ssh

        return multinode.launch(config)
    return LocalJob(config).run()
