"""What `tandem run` refuses about an elastic job's options (--min-np/--max-np, the discovery
script), before anything starts: the reason in words, or None."""

from __future__ import annotations

import os

from tandem.launch.mpi.fault_tolerance import elastic_mpi_refusal


def elastic_problem(config) -> str | None:
    """Why the `LaunchConfig` `config` cannot run as asked, or None."""
    if not config.elastic:
        if config.discovery is not None:
            return ("--host-discovery-script is for elastic jobs: give --min-np A --max-np B "
                    "(or -np A:B) too")
        return None
    low, high = config.min_np, config.max_np
    for flag, value in (("--min-np", low), ("--max-np", high)):
        if value is not None and value < 1:
            return f"{flag} {value}: give 1 or more"
    if low is not None and high is not None and low > high:
        return (f"--min-np {low} is larger than --max-np {high}: the job could never have a "
                "size; give --min-np <= --max-np")
    if config.nnodes > 1:  # -np is this node's share, the range the whole job's
        if high is not None and config.np > high:
            return (f"-np {config.np} on this node is more than the job's --max-np {high}: "
                    f"give each node -np N <= {high}")
    elif not (low or 1) <= config.np <= (high or config.np):
        return (f"-np {config.np} is outside --min-np {low} .. --max-np {high}: the job starts "
                "with -np ranks, so give a number in the range")
    script = config.discovery
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        why = "is not executable (chmod +x it)" if os.path.isfile(script) else "does not exist"
        return (f"--host-discovery-script {script} {why}: it must be a program that prints "
                "`host:slots` lines")
    if config.backend == "mpi":
        return elastic_mpi_refusal()  # names this MPI and what shrinking would need
    if config.max_restarts:
        return ("an elastic job (--min-np/--max-np) replaces --max-restarts: it goes on without "
                "a failed rank instead of restarting them all; drop one of them")
    if config.nnodes > 1 and config.discovery is not None:
        return ("--host-discovery-script grows a one-machine job or a -H job; with --nnodes "
                "agents, the job grows when another node's agent joins: drop it")
    return None
