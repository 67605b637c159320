"""`td.init` and torch.distributed on one world, whichever the script starts first.

- `td.init()` first: Gloo and NCCL initialise torch's default group as they always did
  (`TorchBackend.create`); on MPI `handover` makes tandem's process group (`torch_pg`) the
  default group, over the very engine `td.init` created. Either way `dist.is_initialized()`
  is true after `td.init()`, so `DistributedSampler`, torch's DDP, `dist.get_rank()` and
  `destroy_process_group()` work on MPI too. `release` takes that group down at `td.shutdown`.
- `dist.init_process_group(...)` first (a torchrun script that calls `td.init()` later):
  `existing` finds the group and `td.init` uses it rather than failing: tandem's own group
  (its engine, already watched, stays torch's to release), or torch's Gloo/NCCL group (driven
  through `TorchBackend`, left for the script to destroy). A `td.init(backend=...)` that asks
  for another backend than the group's is an error that names both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.comm.engines.backend import Backend
from tandem.comm.engines.torch_backend import TorchBackend
from tandem.comm.torch_pg import register as torch_register
from tandem.job.environments import JobEnvironment

handover = torch_register.handover


@dataclass(frozen=True)
class Found:
    """The engine under a default group the script made; `watched`: tandem's own group, whose
    engine the watchdog already wraps."""

    engine: Backend
    watched: bool


def _check(asked: str | None, engine: str, running: str) -> None:
    if asked is not None and asked.strip().lower() != engine:
        raise ValueError(
            f"td.init(backend={asked!r}): torch.distributed is already initialised with backend "
            f"{running!r} (tandem's engine: {engine!r}) on this world, and tandem joins it. Ask "
            f"for {engine!r} (or no backend), or initialise torch.distributed with the backend "
            "you want, or call dist.destroy_process_group() before td.init()")


def existing(asked: str | None, job: JobEnvironment, device: torch.device) -> Found | None:
    """The script's own default group as an engine for `td.init`, or None when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    running = dist.get_backend()
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (job.rank, job.size):
        raise ValueError(
            f"td.init: torch.distributed is initialised as rank {rank} of {size}, but the job "
            f"({job.source}) says rank {job.rank} of {job.size}; initialise both from the same "
            "launcher (or call td.init(rank=..., world_size=...) with torch's numbers)")
    engine = torch_register.default_engine()
    if engine is not None:
        _check(asked, engine.name, running)
        return Found(engine, watched=True)
    if running not in ("gloo", "nccl"):
        raise ValueError(
            f"td.init: torch.distributed was initialised with backend {running!r}, which tandem "
            "cannot drive: initialise it with 'gloo', 'nccl', 'tandem' or 'mpi', or call "
            "dist.destroy_process_group() before td.init()")
    _check(asked, running, running)
    return Found(TorchBackend(running, rank, size, device, owns=False), watched=False)


def release(engine: Backend) -> None:
    """Destroy torch's default group if it is the one `handover` made over `engine`."""
    if dist.is_initialized() and torch_register.default_engine() is engine:
        dist.destroy_process_group()
