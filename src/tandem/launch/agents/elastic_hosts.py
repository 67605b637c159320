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

from tandem.launch.agents import control, ssh
from tandem.launch.agents.elastic import ElasticJob
from tandem.launch.agents.ssh import HostAgents
from tandem.launch.config import LaunchConfig, LaunchError


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
    master_host = ssh.master_towards([host for host, _ in others])
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
