"""`launch(config)`: pick the front end that runs a `LaunchConfig`, and check what it needs.

Local processes go to `agent.LocalAgent`; `--backend mpi` goes to `mpiexec.launch`;
`--max-restarts`, `--nnodes` and remote hosts (`-H node1:4`) go to `multinode.launch`.
"""

from __future__ import annotations

import os

from tandem.launch.agent import LocalAgent
from tandem.launch.config import LaunchConfig, LaunchError


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


def launch(config: LaunchConfig) -> int:
    """Run the job `config` describes; return its exit code (0, or the first failing rank's)."""
    if config.backend == "mpi":
        from tandem.launch import mpiexec

        return mpiexec.launch(config)
    check_program(config)
    if config.max_restarts or config.nnodes > 1 or config.remote_hosts:
        from tandem.launch import multinode  # restarts, several agents, ssh

        return multinode.launch(config)
    return LocalAgent(config).run()
