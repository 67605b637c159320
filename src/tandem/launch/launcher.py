"""`launch(config)`: decide the backend, pick the front end that runs a `LaunchConfig`, and
check what it needs.

Without `--backend` (or TANDEM_BACKEND) the backend is `default_backend(config)`: NCCL with
GPUs, else MPI when it can run this job, else Gloo. MPI jobs go to `mpiexec.launch`; Gloo and
NCCL jobs to `agent.LocalAgent`, or, with `--max-restarts`, `--nnodes` or remote hosts
(`-H node1:4`), to `multinode.launch`.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tandem import environments
from tandem.launch.agent import LocalAgent
from tandem.launch.config import LaunchConfig, LaunchError
from tandem.runtime import mpi4py_available


def check_program(config: LaunchConfig) -> None:
    """A missing script is our error (nothing starts); a missing module is each rank's."""
    if config.module:
        return  # importable only in the ranks' environment, so let them say so
    if not os.path.isfile(config.program):
        where = os.path.abspath(config.program)
        hint = ""
        dotted = all(part.isidentifier() for part in config.program.split("."))
        if dotted and not config.program.endswith(".py"):
            hint = f"; if it is a module, run it with -m {config.program}"
        raise LaunchError(f"the script {config.program!r} does not exist ({where}){hint}")


def _mpi_usable() -> bool:
    """mpi4py is importable and an `mpiexec` can be found to start the ranks."""
    from tandem.launch.mpiexec import find_mpiexec

    if not mpi4py_available():
        return False
    try:
        find_mpiexec()
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
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return "nccl"
    local_only = not config.hosts and config.nnodes == 1 and config.max_restarts == 0
    if local_only and (_mpi_usable() if mpi is None else mpi):
        return "mpi"
    return "gloo"


def with_backend(config: LaunchConfig) -> LaunchConfig:
    """`config` with its backend decided: --backend, else TANDEM_BACKEND, else the default."""
    if config.backend is not None:
        return config
    named = (environments.setting("BACKEND") or "").strip().lower()
    return dataclasses.replace(config, backend=named or default_backend(config))


def launch(config: LaunchConfig) -> int:
    """Run the job `config` describes; return its exit code (0, or the first failing rank's)."""
    # Decided here, once, and handed to every rank as TANDEM_BACKEND: td.init() then agrees
    # with the front end that started the ranks (mpiexec or not).
    config = with_backend(config)
    if config.backend == "mpi":
        from tandem.launch import mpiexec

        return mpiexec.launch(config)
    check_program(config)
    if config.max_restarts or config.nnodes > 1 or config.remote_hosts:
        from tandem.launch import multinode  # restarts, several agents, ssh

        return multinode.launch(config)
    return LocalAgent(config).run()
