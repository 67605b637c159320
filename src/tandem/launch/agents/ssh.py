"""`tandem run -H node1:4,node2:4`: where the ranks go, and the commands that start remote agents.

Ranks fill the hosts in order, as many as each host has slots, until `-np` are placed
(horovodrun's rule). This machine coordinates the job (it is node 0, see `restart`): when it is
the first host it also runs that host's ranks, otherwise it runs none. Every other host gets an
agent, `tandem run --nnodes N --node-rank R --master ADDR:PORT --secret - -np n ...`, started
over ssh (`ssh -o BatchMode=yes host 'cd <cwd> && exec env PYTHONPATH=... <python> -m tandem
run ...'`), or as a plain local process when the host is this machine. The job's secret goes to
each agent on its standard input, never on a command line that `ps` would show. Like
horovodrun, this assumes the same Python, the same tandem and the same working directory on
every host, and password-less ssh. An ssh session starts with a fresh environment, so the
agent gets the variables that decide which tandem runs and how (`forwarded_environment`:
PYTHONPATH, the thread limits, the `TANDEM_*` settings; never the secret nor `tandem run`'s own
options, which travel as flags).

Before anything starts, each remote host is asked to run `true` over ssh, all at once
(`check_reachable`, horovodrun's check): a host that cannot be reached is named with its
address and ssh's own words, instead of a job that waits for an agent that never comes.

The command construction is pure and unit-tested; tests/test_cluster.py runs it for real
against an sshd per host in network namespaces (scripts/netns-cluster.sh).
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from tandem.launch.agents import control
from tandem.launch.agents.hosts import Host
from tandem.launch.config import OPTIONS, LaunchConfig, LaunchError
from tandem.launch.events import AgentExited
from tandem.launch.local.output import block_agent_signals
from tandem.launch.local.processes import KILL_WAIT_S, signal_group

CONNECT_TIMEOUT_S = 10
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}")
CHECK_S = CONNECT_TIMEOUT_S + 20.0  # `ssh host true`: connect, authenticate, run, exit
AGENTS_EXIT_S = 15.0  # how long the agents may take to exit after the job ends
FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# `tandem run`'s own options reach an agent as flags (agent_arguments), and an agent given
# both --nnodes and TANDEM_HOSTS would refuse to start; the secret goes over stdin.
NOT_FORWARDED = frozenset(option.variable for option in OPTIONS) | {"TANDEM_SECRET"}


def place(np: int, hosts: Sequence[Host]) -> list[tuple[Host, int]]:
    """How many ranks each host runs: fill the hosts in order; hosts left with none are dropped."""
    placed, left = [], np
    for host in hosts:
        count = min(host.slots, left)
        if count:
            placed.append((host, count))
        left -= count
    return placed


def unused(np: int, hosts: Sequence[Host], standby: bool = False) -> str | None:
    """A note naming the hosts that `place` gives no rank (more slots than -np), or None.
    `standby` (restarts allowed): they take the place of a host that is lost."""
    placed = {host for host, _ in place(np, hosts)}
    idle = [host for host in hosts if host not in placed]
    if not idle:
        return None
    names = ", ".join(f"{host.name}:{host.slots}" for host in idle)
    if standby:
        return (f"tandem run: -np {np} fills the first host(s); {names} stand(s) by, to take "
                f"the place of a host that is lost (--max-restarts)")
    total = sum(host.slots for host in hosts)
    return (f"tandem run: -np {np} fills the first host(s); {names} get(s) no rank and no "
            f"agent (the hosts offer {total} slots: give -np {total} to use them all)")


def check_hosts(hosts: Sequence[Host]) -> dict[str, str]:
    """Each remote host's address; a `LaunchError` for a name that does not resolve, or when
    ssh is missing."""
    remote = [host for host in hosts if not host.is_local]
    if remote and shutil.which("ssh") is None:
        raise LaunchError("remote hosts need ssh, and there is no `ssh` on PATH")
    addresses = {}
    for host in remote:
        try:
            addresses[host.name] = socket.getaddrinfo(host.name, None)[0][4][0]
        except OSError as error:
            raise LaunchError(
                f"cannot resolve the host {host.name!r} ({error.strerror or error}): check the "
                "name in -H/--hostfile, or give its address"
            ) from None
    return addresses


def check_reachable(addresses: Mapping[str, str], timeout: float = CHECK_S) -> None:
    """Run `ssh host true` on every host at once; a `LaunchError` naming each that failed."""
    problems: dict[str, str] = {}

    def probe(name: str) -> None:
        try:
            done = subprocess.run(["ssh", *SSH_OPTIONS, name, "true"], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            problems[name] = f"`ssh {name} true` did not finish within {timeout:g} s"
            return
        except OSError as error:
            problems[name] = f"cannot run ssh: {error.strerror or error}"
            return
        if done.returncode:
            words = " ".join(done.stderr.split()) or "no message"
            problems[name] = f"ssh exited with code {done.returncode}: {words}"

    threads = [threading.Thread(target=probe, args=(name,), daemon=True) for name in addresses]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5.0)  # subprocess.run's timeout ends each one before this
    if problems:
        lines = [f"  {name} ({addresses[name]}): {problems[name]}" for name in sorted(problems)]
        raise LaunchError(
            "cannot reach {} over ssh:\n{}\n-H hosts must accept `ssh -o BatchMode=yes HOST` from "
            "this machine without a password (keys in ~/.ssh, the host in known_hosts)".format(
                ", ".join(sorted(problems)), "\n".join(lines))
        )


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
    if config.elastic:  # an elastic job's agent (`elastic_hosts`)
        args += ["--min-np", str(config.min_np or 1), "--max-np", str(config.max_np or nproc)]
    if config.module:
        args.append("-m")
    return [*args, config.program, *config.args]


def forwarded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a remote agent gets from ours: which tandem runs (PYTHONPATH), thread limits, and
    the `TANDEM_*` settings the ranks read (TANDEM_TIMEOUT, TANDEM_DEBUG...)."""
    return {name: value for name, value in sorted(environ.items())
            if (name in FORWARDED or name.startswith("TANDEM_")) and name not in NOT_FORWARDED}


def agent_command(host: Host, arguments: Sequence[str], cwd: str,
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """`arguments` as a local command, or wrapped in ssh for a remote host (with our
    `forwarded_environment`: an ssh session starts without it)."""
    if host.is_local:
        return list(arguments)
    env = forwarded_environment(os.environ if environ is None else environ)
    prefix = shlex.join(["env", *(f"{name}={value}" for name, value in env.items())]) + " " \
        if env else ""
    remote = f"cd {shlex.quote(cwd)} && exec {prefix}{shlex.join(arguments)}"
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


def master_towards(hosts: Sequence[Host]) -> str:
    """The address the agents on `hosts` reach this machine at: the route towards the first
    remote one (127.0.0.1 when every host is this machine)."""
    remote = next((host for host in hosts if not host.is_local), None)
    return control.local_address_towards(remote.name) if remote else "127.0.0.1"


class HostAgents:
    """The agents node 0 starts on the hosts of -H/--hostfile (fixed or elastic), by node rank:
    each started over ssh (`agent_command`), its exit an `AgentExited` event on `events`."""

    def __init__(self, config: LaunchConfig, secret: str, master_host: str, nnodes: int,
                 events: queue.SimpleQueue) -> None:
        self.config, self.secret, self.master_host = config, secret, master_host
        self.nnodes, self.events = nnodes, events
        self.port = 0  # the store's, once it listens
        self.agents: dict[int, subprocess.Popen] = {}
        self.hosts: dict[int, str] = {}  # node rank -> host name (0: this machine)

    def start(self, host: Host, slots: int, node: int | None = None) -> int | None:
        """Start an agent on `host` with `slots` as node `node` (default: the lowest free node
        rank); its node rank (None: no rank left)."""
        if node is None:
            node = next((n for n in range(1, self.nnodes) if n not in self.hosts), None)
            if node is None:
                return None
        arguments = agent_arguments(self.config, node_rank=node, nnodes=self.nnodes,
                                    master=(self.master_host, self.port), nproc=slots)
        agent = start_agent(agent_command(host, arguments, os.getcwd()), self.secret)
        self.agents[node], self.hosts[node] = agent, host.name
        threading.Thread(target=self._report_exit, args=(agent, node, host.name), daemon=True,
                         name=f"tandem-agent{node}-wait").start()
        return node

    def _report_exit(self, agent: subprocess.Popen, node: int, name: str) -> None:
        block_agent_signals()
        code = agent.wait()
        if self.agents.get(node) is agent:  # not an agent that another took the place of
            self.events.put(AgentExited(node, name, code))

    def forget(self, node: int) -> None:
        """Node `node` is lost: its agent goes (its ssh may wait for a host that is gone);
        first, so that its exit is not taken for a replacement's."""
        agent = self.agents.pop(node, None)
        self.hosts.pop(node, None)
        if agent is not None:
            signal_group(agent.pid, signal.SIGKILL)

    def replace(self, node: int, slots: int, spares: list[Host]) -> str | None:
        """A lost node's agent goes; the first spare host with `slots`, reachable over ssh,
        takes its place under the same node rank: its name, or None when none is left."""
        self.forget(node)
        while spares:
            host = spares.pop(0)
            if host.slots < slots:
                continue
            try:
                check_reachable(check_hosts([host]))
            except LaunchError as error:
                print(f"tandem run: {error}", file=sys.stderr, flush=True)
                continue
            self.start(host, slots, node)
            return host.name
        return None

    def discovered(self, offered: dict[str, int]) -> None:
        """Start an agent on every listed host that runs none."""
        running = set(self.hosts.values())
        for name, slots in offered.items():
            if name not in running and slots > 0:
                self.start(Host(name, slots), slots)

    def close(self, lost: set[int] = frozenset()) -> None:
        """Wait for the agents to exit after the job (`AGENTS_EXIT_S` in all), killing those of
        `lost` nodes at once and any left after it."""
        deadline = time.monotonic() + AGENTS_EXIT_S
        for node, agent in list(self.agents.items()):
            if node in lost:  # its ssh may wait for a host that is gone
                signal_group(agent.pid, signal.SIGKILL)
            try:
                agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(agent.pid, signal.SIGKILL)
                agent.wait(KILL_WAIT_S)
            self.agents.pop(node, None)
