"""`tandem run --min-np A --max-np B -H h0:4,h1:4` (or `--hostfile`): an elastic job whose
agents this machine starts, over ssh, and whose discovery script may list new hosts.

This machine, the first host of the list, is node 0 (`elastic.ElasticJob`); every other host
that `ssh.place` gives ranks gets an agent (`ssh.agent_command`, as a fixed `-H` job does), node
ranks 1, 2... With `--host-discovery-script`, each `host:slots` line is a machine the job may
use: a host that no agent runs on (a new one, or one whose agent was lost) gets one, under the
lowest free node rank, and the job grows onto it at the next commit; node 0's own line sets its
slots. A host whose agent is lost is not replaced by this launcher: it leaves the job (one round
without its ranks) until the discovery script lists it again.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading

from tandem.launch.agents import control, ssh
from tandem.launch.agents.elastic import ElasticJob
from tandem.launch.agents.hosts import Host
from tandem.launch.config import LaunchConfig, LaunchError
from tandem.launch.local.output import block_agent_signals
from tandem.launch.local.processes import KILL_WAIT_S, signal_group

AGENTS_EXIT_S = 15.0  # how long the agents may take to exit after the job ends


class HostAgents:
    """The agents node 0 started, by node rank; which host each runs on."""

    def __init__(self, config: LaunchConfig, secret: str, master_host: str, nnodes: int,
                 events) -> None:
        self.config, self.secret, self.master_host = config, secret, master_host
        self.nnodes, self.events = nnodes, events
        self.port = 0  # the store's, once it listens
        self.agents: dict[int, subprocess.Popen] = {}
        self.hosts: dict[int, str] = {}  # node rank -> host name (0: this machine)

    def start(self, host: Host, slots: int) -> int | None:
        """Start an agent on `host` with `slots`; its node rank (None: no rank left)."""
        node = next((n for n in range(1, self.nnodes) if n not in self.hosts), None)
        if node is None:
            return None
        arguments = ssh.agent_arguments(self.config, node_rank=node, nnodes=self.nnodes,
                                        master=(self.master_host, self.port), nproc=slots)
        agent = ssh.start_agent(ssh.agent_command(host, arguments, os.getcwd()), self.secret)
        self.agents[node], self.hosts[node] = agent, host.name
        threading.Thread(target=self._report_exit, args=(agent, node, host.name), daemon=True,
                         name=f"tandem-agent{node}-wait").start()
        return node

    def _report_exit(self, agent: subprocess.Popen, node: int, name: str) -> None:
        block_agent_signals()
        code = agent.wait()
        if self.agents.get(node) is agent:
            self.events.put(("agent-exited", node, name, code))

    def forget(self, node: int) -> None:
        """Node `node` is lost: its agent goes (its ssh may wait for a host that is gone)."""
        agent = self.agents.pop(node, None)
        self.hosts.pop(node, None)
        if agent is not None:
            signal_group(agent.pid, signal.SIGKILL)

    def discovered(self, offered: dict[str, int]) -> None:
        """Start an agent on every listed host that runs none."""
        running = set(self.hosts.values())
        for name, slots in offered.items():
            if name not in running and slots > 0:
                self.start(Host(name, slots), slots)

    def close(self) -> None:
        for node, agent in list(self.agents.items()):
            try:
                agent.wait(AGENTS_EXIT_S)
            except subprocess.TimeoutExpired:
                signal_group(agent.pid, signal.SIGKILL)
                agent.wait(KILL_WAIT_S)
            self.agents.pop(node, None)


def launch_hosts(config: LaunchConfig) -> int:
    """An elastic -H/--hostfile job: this machine is node 0 and starts the others' agents."""
    placed = ssh.place(config.np, config.hosts)
    first = config.hosts[0]
    if not first.is_local:
        raise LaunchError(f"an elastic -H job runs node 0 here: list this machine first "
                          f"(-H localhost:N,{first.name}:...), or start one agent per machine "
                          f"with --nnodes")
    others = [(host, count) for host, count in placed if host is not first]
    ssh.check_reachable(ssh.check_hosts([host for host, _ in others]))
    remote = next((h for h, _ in others if not h.is_local), None)
    master_host = control.local_address_towards(remote.name) if remote else "127.0.0.1"
    here = next((count for host, count in placed if host is first), 0)
    # every host has a slot, so the job never has more than --max-np (or the list's) nodes
    nnodes = max(config.max_np or config.np, len(config.hosts)) + 1
    secret = control.new_secret()
    local = dataclasses.replace(config, np=max(here, 1), hosts=(), nnodes=nnodes, node_rank=0,
                                master=(master_host, 0), discovery=None)
    job = ElasticJob(local, secret, expected_nodes=1 + len(others))
    job.discovery = config.discovery  # run here only
    agents = HostAgents(local, secret, master_host, nnodes, job.events)
    agents.hosts[0] = first.name
    job.agents = agents

    def start_agents(port: int) -> None:
        agents.port = port
        for host, count in others:
            agents.start(host, count)

    job.on_listening = start_agents
    try:
        return job.run()
    finally:
        agents.close()


__all__ = ["HostAgents", "launch_hosts"]
