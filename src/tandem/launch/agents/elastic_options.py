"""What `tandem run` refuses about an elastic job's options (--min-np/--max-np, the discovery
script), before anything starts: the reason in words, or None."""

from __future__ import annotations

import os
import sys

from tandem.launch.agents.discovery import discover
from tandem.launch.agents.hosts import total_slots
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
    if config.hosts and low is not None and low > total_slots(config.hosts):
        listed = ",".join(f"{host.name}:{host.slots}" for host in config.hosts)
        return (f"--min-np {low} is more than the {total_slots(config.hosts)} slot(s) the hosts "
                f"{listed} (-H/--hostfile) give: the job starts on them with at least --min-np "
                f"ranks, so it could never start; lower --min-np to "
                f"{total_slots(config.hosts)} or less, or list more hosts or slots")
    timeout = config.discovery_timeout
    if timeout is not None and not timeout > 0:
        return f"--discovery-timeout {timeout:g}: give a positive number of seconds"
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


def discovery_problem(config) -> str | None:
    """Run the discovery script once before anything starts: why the job is refused, or None.

    A script that cannot run, exits non-zero, prints junk or runs past --discovery-timeout is
    refused now (exit 2), while nothing is lost; horovodrun stops on such a script too. What it
    offers is not checked against --min-np: the job starts with -np ranks on this machine (or
    the -H hosts) whatever the script says, and grows when it offers more, so an offer below
    --min-np is said on one line (a script that may offer more later) and the job starts."""
    if config.discovery is None or not config.elastic:
        return None
    offered, problem = discover(config.discovery, config.discovery_timeout)
    if problem is not None:
        return (f"--host-discovery-script {config.discovery}: {problem}. Nothing was started; "
                "fix the script (run it by hand: it prints `host:slots` lines and exits 0)")
    slots = sum(offered.values())
    if config.min_np is not None and slots < config.min_np:
        print(f"tandem run: note: --host-discovery-script {config.discovery} offers {slots} "
              f"slot(s) now, fewer than --min-np {config.min_np}: the job starts with -np "
              f"{config.np} rank(s) anyway, and grows only when it offers more slots than the "
              "job has", file=sys.stderr, flush=True)
    return None
