"""`TandemEnvironment`: Lightning's view of a job that tandem's launchers started.

Lightning asks a `ClusterEnvironment` who this process is before anything communicates. The
answer comes from `tandem.job.environments` (the one place tandem reads launcher variables), so a
job started by `tandem run`, torchrun, mpiexec (Open MPI, MPICH) or srun is seen exactly as
`td.init()` will see it. The processes always exist already: no Lightning launcher starts any.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment

from tandem.job.environments import JobEnvironment, detect, launched


class TandemEnvironment(ClusterEnvironment):
    """The rank, world size and node layout that tandem's launcher gave this process."""

    def __init__(self) -> None:
        super().__init__()
        self._job: JobEnvironment = detect(os.environ)

    @property
    def job(self) -> JobEnvironment:
        return self._job

    @property
    def creates_processes_externally(self) -> bool:
        return True  # tandem run, mpiexec, srun or torchrun started every rank already

    @property
    def main_address(self) -> str:
        return self._job.master_addr or "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self._job.master_port or 0

    @staticmethod
    def detect() -> bool:
        """True in any job a tandem-supported launcher started (tandem run, torchrun, MPI, SLURM)."""
        return launched(os.environ) is not None

    def world_size(self) -> int:
        return self._job.size

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides; a different number of devices is refused at set-up

    def global_rank(self) -> int:
        return self._job.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # as set_world_size: the launcher's rank is the rank

    def local_rank(self) -> int:
        return self._job.local_rank

    def node_rank(self) -> int:
        # Ranks are numbered node by node (tandem run -H, --nnodes, srun's block layout).
        return self._job.rank // max(self._job.local_size, 1)

    def local_size(self) -> int:
        return self._job.local_size

    def num_nodes(self) -> int:
        return -(-self._job.size // max(self._job.local_size, 1))
