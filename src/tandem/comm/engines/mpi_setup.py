"""Joining MPI: importing mpi4py, meeting with a deadline, and telling `tandem run` we joined.

What `MPIBackend.create` (and the torch.distributed backend, `torch_register`) do once per
process before the first message, kept apart from the operations in `mpi_backend`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tandem import rendezvous
from tandem.job.environments import JobEnvironment


def import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(
            f"backend 'mpi' needs mpi4py ({error}): pip install mpi4py mpich, "
            "or choose backend='gloo'"
        ) from None
    return MPI


def spare_core(local_size: int) -> bool:
    """Whether a progress thread would find a core that compute leaves idle.

    It moves MPI along while the training thread computes, which pays only when a core is
    free: with GPUs, or with fewer compute threads than cores. When the local ranks' torch
    threads fill every core (what `tandem run` and `mpiexec` give by default), the thread takes
    time from compute: tandem's MLP step on 2 ranks and 2 cores took 50 ms with it, 47 ms
    without (`TANDEM_MPI_PROGRESS=thread|none tandem run -np 2 benchmarks/dp_vs_ddp.py
    --models mlp`), and the docstring of `mpi_progress` measures the same.
    """
    if torch.cuda.is_available():
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return local_size * torch.get_num_threads() < (cores or 1)


def show_launcher(job: JobEnvironment) -> None:
    """Connect once to the store of the `tandem run` agent that started this rank: the agent
    counts the ranks that joined (a job that none joined ran N independent copies, which it
    says, `launch/local/joined.py`). Gloo and NCCL meet on that store anyway; MPI needs no store."""
    if job.source != "tandem" or not job.store_hosted or job.master_port is None \
            or job.store_key is None:
        return
    try:
        rendezvous.StoreClient(job.master_addr or "127.0.0.1", job.master_port, job.store_key,
                               5.0).close()
    except Exception:
        pass  # only the agent's end-of-job remark depends on it


def arrive(MPI: Any, comm: Any, timeout: float, what: str) -> None:
    """A barrier with a deadline before a blocking collective call (Dup, Create) that has none."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        os.sched_yield()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"MPI {what}: not every rank of {comm.Get_size()} arrived within {timeout:g} s"
            )
