"""The MPI front end of `tandem run --backend mpi`: ranks started through `mpiexec`.

A seam for now: `launch(config)` is called by `tandem.launch.launcher.launch` whenever
`config.backend == "mpi"`, and returns the job's exit code once implemented.
"""

from __future__ import annotations

from tandem.launch.config import LaunchConfig, LaunchError


def launch(config: LaunchConfig) -> int:
    """Run the job under `mpiexec -n config.np` and return its exit code."""
    raise LaunchError(
        "--backend mpi is not yet supported by `tandem run`. For now start the job with "
        f"`mpiexec -n {config.np} python {config.program}` (td.init() picks up MPI), "
        "or use --backend gloo"
    )
