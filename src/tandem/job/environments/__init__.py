"""How a process learns its place in the job: launcher adapters, and `td.init`'s arguments.

- `adapters`: one small adapter per launcher (tandem, torchrun, Open MPI, MPICH, SLURM),
  `detect()` (the first that recognises the environment, else a world of one),
  `tandem_variables()` for what a tandem launcher sets, `torchrun_variables()` for the
  torchrun variables it sets too. Stdlib only. (`TANDEM_*` settings are
  `tandem.job.settings`'.)
- `manual`: `resolve()`, which adds what `td.init(rank=, world_size=, init_method=)` says:
  torch.distributed's manual template, a job no launcher describes, checked against any launcher.

This package is the only place in tandem that reads job-discovery variables (RANK, MASTER_ADDR,
OMPI_COMM_WORLD_RANK, SLURM_PROCID...).
"""

from tandem.job.environments.adapters import (
    ADAPTERS,
    Env,
    JobEnvironment,
    check_half_set,
    detect,
    detect_mpich,
    detect_openmpi,
    detect_slurm,
    detect_tandem,
    detect_torchrun,
    first_slurm_host,
    horovod_variables,
    launched,
    single_process,
    tandem_variables,
    torchrun_variables,
)
from tandem.job.environments.manual import check_rank_arguments, rendezvous_address, resolve

__all__ = [
    "ADAPTERS",
    "Env",
    "JobEnvironment",
    "check_half_set",
    "check_rank_arguments",
    "detect",
    "detect_mpich",
    "detect_openmpi",
    "detect_slurm",
    "detect_tandem",
    "detect_torchrun",
    "first_slurm_host",
    "launched",
    "rendezvous_address",
    "resolve",
    "single_process",
    "horovod_variables",
    "tandem_variables",
    "torchrun_variables",
]
