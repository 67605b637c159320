"""Multi-node jobs: one agent per machine, joined by an authenticated control plane.

    node0$ tandem run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -np 4 train.py
    node1$ tandem run --nnodes 2 --node-rank 1 --master 10.0.0.1:29500 --secret S -np 4 train.py

Node 0's agent (`coordinator.Coordinator`) hosts the rendezvous store at ADDR:PORT, the job's
one port: every other agent (`member.Member`, the same for elastic jobs) connects there, and
the store hands its connection over to node 0's control plane once it proved the job's secret
(`--secret`/`TANDEM_SECRET`; node 0 generates one and prints it when none is given; `--secret
-` reads it from standard input). A firewall between the nodes need only let that port through
(and Gloo's).
Node 0 admits each node once (a node rank out of range, a duplicate or a different `--nnodes`
is refused with the reason) and assigns the ranks: node r runs ranks r*np .. r*np+np-1 (each
node's own -np, in node order).

Then each attempt: node 0 says "workers" with the placement (as it does for an elastic round's
new workers), every agent runs its ranks and reports each exit (a failure at once, and with its
last lines); the first failure anywhere stops every rank on every node; once every rank is
down node 0 restarts the job (`--max-restarts`) or sends "finish" with the summary, which
every agent prints before exiting with the job's code.
An agent that goes silent for the timeout (`--timeout`, at most 4 s) is unreachable: the
others stop their ranks and say so. `tandem run --max-restarts K` on one machine is the same
coordinator with no other nodes and a store on 127.0.0.1 only.

Gloo must reach the other nodes: unless GLOO_SOCKET_IFNAME is set, each agent points its ranks
at the interface that routes to the master address, and node 0 at the interface the other
agents reached it through. Node 0 listens at the master address, which must be one of its own
(`listen_address`: another is an error naming this machine's addresses); a master *name* that
resolves to loopback here (Debian's `127.0.1.1 node0` line in /etc/hosts) while the other
nodes know it by a network address makes node 0 listen on every interface instead, since the
store and the control plane admit only holders of the job's secret.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import sys
from typing import TextIO

from tandem import rendezvous
from tandem.launch.agents import control, ssh
from tandem.launch.agents.coordinator import Coordinator
from tandem.launch.agents.elastic import Rounds
from tandem.launch.agents.hosts import LOCAL_NAMES, holds_address
from tandem.launch.agents.member import Member
from tandem.launch.config import LaunchConfig, LaunchError
from tandem.launch.local.ranks import MASTER_ADDR


def gloo_interface(master_host: str) -> str | None:
    """The interface this machine reaches `master_host` through (for GLOO_SOCKET_IFNAME)."""
    try:
        return control.interface_of(control.local_address_towards(master_host))
    except OSError:
        return None


def listen_address(master: tuple[str, int], nnodes: int) -> str:
    """Where node 0 listens for --master ADDR:PORT (see the module docstring); a `LaunchError`
    when ADDR is not this machine's."""
    host, port = master
    try:
        address = socket.gethostbyname(host)
    except OSError as error:
        raise LaunchError(f"--master {host}:{port}: cannot resolve {host!r} "
                          f"({error.strerror or error}); give node 0's address") from None
    literal = host in LOCAL_NAMES or _is_address(host)
    if nnodes > 1 and not literal and ipaddress.ip_address(address).is_loopback:
        return "0.0.0.0"  # reachable from the others at whatever address they know it by
    if not holds_address(address):
        here = ", ".join(f"{ip} ({name})" for name, ip in control.local_addresses().items())
        raise LaunchError(
            f"--master {host}:{port}: this machine ({socket.gethostname()}) has no address "
            f"{address}; node 0 hosts the rendezvous there, so --master must name one of node "
            f"0's addresses (here: {here}), the same on every node"
        )
    return host


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def job_secret(config: LaunchConfig, stdin: TextIO | None = None) -> str:
    """The secret of a multi-node job's agent (fixed or elastic): --secret, TANDEM_SECRET, or
    standard input with --secret -. Node 0 makes one when none is given, and prints it for the
    other nodes; another node without one is a `LaunchError`."""
    if config.secret == "-":
        line = (stdin or sys.stdin).readline().strip()
        if not line:
            raise LaunchError("--secret -: expected the secret on standard input, got nothing")
        return line
    if config.secret is not None:
        return config.secret
    if config.node_rank != 0:
        raise LaunchError(f"node {config.node_rank} needs the job's secret: pass --secret S (or "
                          "set TANDEM_SECRET) with the value node 0 printed or was given")
    secret = control.new_secret()
    print(f"tandem run: no --secret given: this job's secret is {secret}; start the other "
          f"nodes with --secret {secret} (or TANDEM_SECRET={secret})", file=sys.stderr, flush=True)
    return secret


def launch_hosts(config: LaunchConfig) -> int:
    """-H/--hostfile with remote hosts (or any elastic -H job): this machine is node 0, the
    other hosts get agents over ssh. A fixed job runs node 0's ranks here only when this machine
    is the first host; an elastic one must list it first."""
    elastic = config.elastic
    placed = ssh.place(config.np, config.hosts)
    first, first_count = placed[0]
    if elastic and not config.hosts[0].is_local:
        raise LaunchError(f"an elastic -H job runs node 0 here: list this machine first "
                          f"(-H localhost:N,{config.hosts[0].name}:...), or start one agent per "
                          f"machine with --nnodes")
    here = first_count if first.is_local else 0
    others = placed[1:] if first.is_local else placed
    # elastic: every host has a slot, so the job never has more than --max-np (or the list's)
    nnodes = max(config.max_np or config.np, len(config.hosts)) + 1 if elastic else 1 + len(others)
    master = None if elastic else config.master
    # Before anything starts: a master that is not this machine's, unknown names, no ssh,
    # hosts that ssh cannot reach.
    listen = listen_address(master, nnodes) if master is not None else None
    ssh.check_reachable(ssh.check_hosts([host for host, _ in placed]))
    note = None if elastic else ssh.unused(config.np, config.hosts,
                                           standby=config.max_restarts > 0)
    if note:
        print(note, file=sys.stderr, flush=True)
    master_host, port = master or (ssh.master_towards([h for h, _ in others]), 0)
    secret = control.new_secret()
    local = dataclasses.replace(config, np=max(here, 1), hosts=(), discovery=None)  # node 0's
    coordinator = Coordinator(local, nproc=here, nnodes=nnodes, store=(master_host, port),
                              secret=secret, gloo_interface=gloo_interface(master_host),
                              listen=listen, expected_nodes=1 + len(others),
                              rounds=Rounds if elastic else None)
    agents = ssh.HostAgents(config, secret, master_host, nnodes, coordinator.events)
    agents.hosts[0] = config.hosts[0].name
    spares = [host for host in config.hosts if host not in {h for h, _ in placed}]
    if elastic:  # a lost host leaves; discovery may list it (or others) again
        coordinator.rounds.agents, coordinator.rounds.discovery = agents, config.discovery
    else:  # a lost host's ranks go on on a spare host
        coordinator.on_lost = lambda node, count: agents.replace(node, count, spares)

    def start_agents(store_port: int) -> None:
        agents.port = store_port
        for node, (host, count) in enumerate(others, start=1):
            agents.start(host, count, node)

    coordinator.on_listening = start_agents
    coordinator.echo_to_peers = False
    try:
        return coordinator.run()
    finally:
        # the agents of nodes lost (or never joined): their ssh may wait for a host that is gone
        agents.close(lost=set(agents.agents) - set(coordinator.nodes.nodes))


def launch(config: LaunchConfig) -> int:
    """Run a job through the one agent: a plain local one, restarts, several nodes, hosts, an
    elastic range (see the module docstring); return its exit code."""
    rounds = Rounds if config.elastic else None
    try:
        if config.remote_hosts or (config.elastic and config.hosts):
            return launch_hosts(config)
        if config.nnodes == 1:
            # --master on one node: host the store there (a taken port is an error, not ignored).
            return Coordinator(config, nproc=config.np, store=config.master or (MASTER_ADDR, 0),
                               rounds=rounds).run()
        host, port = config.master
        if config.node_rank != 0:
            return Member(config, job_secret(config), gloo_interface(host)).run()
        listen = listen_address(config.master, config.nnodes)  # before a secret is printed
        return Coordinator(config, nproc=config.np, nnodes=config.nnodes, store=(host, port),
                           secret=job_secret(config), listen=listen,
                           gloo_interface=gloo_interface(host), rounds=rounds).run()
    except rendezvous.PortInUseError as error:
        raise LaunchError(str(error)) from None


__all__ = ["Member", "job_secret", "launch", "launch_hosts"]
