"""`tandem run -H node1:4,node2:4`: where the ranks go, and the commands that start remote agents.

Ranks fill the hosts in order, as many as each host has slots, until `-np` are placed
(horovodrun's rule). This machine coordinates the job (it is node 0, see `restart`): when it is
the first host it also runs that host's ranks, otherwise it runs none. Every other host gets an
agent, `tandem run --nnodes N --node-rank R --master ADDR:PORT --secret - -np n ...`, started
over ssh (`ssh -o BatchMode=yes host 'cd <cwd> && exec <python> -m tandem run ...'`), or as a
plain local process when the host is this machine. The job's secret goes to each agent on its
standard input, never on a command line that `ps` would show. Like horovodrun, this assumes
the same Python, the same tandem and the same working directory on every host, and
password-less ssh.

The command construction is pure and unit-tested; running it needs sshd on the hosts, which
the test machine does not have (the local-host path is tested end to end instead).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence

from tandem.launch.config import LaunchConfig, LaunchError
from tandem.launch.hosts import Host

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


def place(np: int, hosts: Sequence[Host]) -> list[tuple[Host, int]]:
    """How many ranks each host runs: fill the hosts in order; hosts left with none are dropped."""
    placed, left = [], np
    for host in hosts:
        count = min(host.slots, left)
        if count:
            placed.append((host, count))
        left -= count
    return placed


def check_hosts(hosts: Sequence[Host]) -> None:
    """A `LaunchError` for a remote host whose name does not resolve, or when ssh is missing."""
    remote = [host for host in hosts if not host.is_local]
    if remote and shutil.which("ssh") is None:
        raise LaunchError("remote hosts need ssh, and there is no `ssh` on PATH")
    for host in remote:
        try:
            socket.getaddrinfo(host.name, None)
        except OSError as error:
            raise LaunchError(
                f"cannot resolve the host {host.name!r} ({error.strerror or error}): check the "
                "name in -H/--hostfile, or give its address"
            ) from None


def agent_arguments(config: LaunchConfig, *, node_rank: int, nnodes: int,
                    master: tuple[str, int], nproc: int,
                    python: str = sys.executable) -> list[str]:
    """The `tandem run` command line of one node's agent."""
    args = [python, "-m", "tandem", "run", "--nnodes", str(nnodes), "--node-rank",
            str(node_rank), "--master", f"{master[0]}:{master[1]}", "--secret", "-",
            "-np", str(nproc)]
    if config.backend:
        args += ["--backend", config.backend]
    if config.threads_per_rank is not None:
        args += ["--threads-per-rank", str(config.threads_per_rank)]
    if config.timeout is not None:
        args += ["--timeout", f"{config.timeout:g}"]
    if config.module:
        args.append("-m")
    return [*args, config.program, *config.args]


def agent_command(host: Host, arguments: Sequence[str], cwd: str) -> list[str]:
    """`arguments` as a local command, or wrapped in ssh for a remote host."""
    if host.is_local:
        return list(arguments)
    remote = f"cd {shlex.quote(cwd)} && exec {shlex.join(arguments)}"
    return ["ssh", *SSH_OPTIONS, host.name, remote]


def start_agent(command: Sequence[str], secret: str, cwd: str | None = None) -> subprocess.Popen:
    """Start one agent; its output goes straight to ours (its lines are already prefixed)."""
    proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, cwd=cwd or os.getcwd(),
                            start_new_session=True)
    try:
        proc.stdin.write((secret + "\n").encode())
        proc.stdin.close()
    except OSError:
        pass  # it died at once; its exit and the coordinator's join deadline will say so
    return proc
