"""An elastic job across machines: one agent per machine, node 0 forms the rounds.

    node0$ tandem run --nnodes 3 --node-rank 0 --master 10.0.0.1:29500 --min-np 2 --max-np 6 \\
               -np 2 train.py
    node1$ tandem run --nnodes 3 --node-rank 1 --master 10.0.0.1:29500 --secret S \\
               --min-np 2 --max-np 6 -np 2 train.py

`-np` is each machine's number of slots, `--min-np/--max-np` the whole job's range of ranks and
`--nnodes` the most machines. Node 0's agent (`elastic.ElasticJob`) hosts the store and the
control plane as a fixed multi-node job does (`multinode`, `control`: the same secret, the same
authentication) and is the only one that forms rounds (`rendezvous.elastic_rounds`): worker ids
are unique in the job, and a round lists them in rank order, whatever machine runs them.

- At the start node 0 waits for every node, or, once the nodes joined offer `--min-np` slots,
  for `START_WINDOW_S` more; round 0 is formed from the machines there (up to `--max-np`).
- A node that joins later (a new machine, or a lost one's agent started again) grows the job
  at the ranks' next `State.commit()`, as a discovery script's new slot does on one machine.
- A worker that fails on another node is reported to node 0 (`("exit", ...)`), which forms the
  next round without it, as for its own ranks. A node whose agent goes away or silent
  (`control.Peer`: its connection closed, or no heartbeat for `lost_after`) loses all its
  workers at once: one round without them.
- The job ends on node 0: it tells every agent (`("finish", ...)`), and each exits with the
  job's code. A node that loses node 0 stops its workers and exits 1.

`ElasticRanks` starts the workers on each machine, `Nodes` is node 0's table of machines,
`member.Member` the agent of nodes 1, 2, ... (fixed or elastic).
"""

from __future__ import annotations

import os
import queue
import socket
import time
from dataclasses import dataclass, field

from tandem import rendezvous
from tandem.launch.agents.admission import admit, await_hang_ups
from tandem.launch.agents.control import ControlServer, Peer
from tandem.launch.agents.coordinator import lost_after
from tandem.launch.config import LaunchConfig, StartError
from tandem.launch.events import (
    AgentExited,
    Joined,
    Lost,
    Rejected,
    Signalled,
)
from tandem.launch.local.output import RankOutput, signals_blocked
from tandem.launch.local.processes import start_failure_code, start_ranks
from tandem.launch.local.ranks import LocalRanks, Placement, rank_command, rank_environment
from tandem.launch.local.supervisor import Failure

START_WINDOW_S = 3.0  # with --min-np slots there, how long node 0 still waits for the others


class ElasticRanks(LocalRanks):
    """The workers of an elastic job on one machine: started in groups, whenever a round adds
    some; the output and the events name each by its worker id (its rank when the job started).
    """

    def start_workers(self, workers: list[int], slots: list[int], first_rank: int, size: int,
                      number: int, store: tuple[str, int], store_key: str,
                      gloo_interface: str | None = None) -> None:
        """Start `workers` on this machine's local `slots` as ranks `first_rank`, ... of a
        world of `size`, for round `number` (-1: a round that will add them, once they are
        ready). `td.init()` reads its place from the store's current round anyway; these are
        where it starts from."""
        self.store_port = store[1]
        placement = Placement(attempt=0, offset=first_rank, world=size, store=store,
                              store_key=store_key, gloo_interface=gloo_interface)
        low, high = self.config.min_np or 1, self.config.max_np or self.config.np
        envs = []
        local_size = max(self.nproc, *(slot + 1 for slot in slots))  # slots offered later
        for index, (worker, slot) in enumerate(zip(workers, slots, strict=True)):
            env = rank_environment(self.config, slot, placement, os.environ, local_size,
                                   rank=first_rank + index)
            env.update(TANDEM_ELASTIC_ROUND=str(number), TANDEM_ELASTIC_WORKER=str(worker),
                       TANDEM_ELASTIC_RANGE=f"{low}:{high}")
            envs.append(env)
        command = rank_command(self.config)
        try:
            processes = start_ranks(command, envs)
        except OSError as error:
            raise StartError(f"could not start {command[0]}: {error.strerror or error}",
                             code=start_failure_code(error)) from None
        for worker, proc in zip(workers, processes, strict=True):
            self.watch(worker, proc.pid, proc.stdout, proc.stderr, proc.wait)


@dataclass
class Node:
    """One machine of the job as node 0 sees it: its slots and the live workers in them."""

    number: int
    host: str
    slots: int
    peer: Peer | None = None  # None: node 0 itself
    workers: dict[int, int] = field(default_factory=dict)  # live worker id -> its local slot

    def capacity(self) -> int:
        """How many more workers it takes."""
        return max(0, self.slots - len(self.workers))

    def free_slots(self, count: int) -> list[int]:
        """The lowest `count` local slot numbers no live worker holds (LOCAL_RANK)."""
        taken = set(self.workers.values())
        return [slot for slot in range(self.slots + len(taken)) if slot not in taken][:count]


class Nodes:
    """Node 0's machines: its own (node 0) and the agents that joined over the control plane."""

    def __init__(self, config: LaunchConfig, events: queue.SimpleQueue, output: RankOutput,
                 secret: str | None, expected: int | None = None) -> None:
        self.config, self.events, self.output = config, events, output
        self.secret = secret
        self.expected = expected or config.nnodes  # how many nodes round 0 waits for
        self.nodes = {0: Node(0, socket.gethostname(), config.np)}
        self.server: ControlServer | None = None

    @property
    def several(self) -> bool:
        return self.config.nnodes > 1

    def open(self, store: rendezvous.StoreServer, listen: str) -> None:
        """Listen for the other agents; tell them where through the store."""
        with signals_blocked():
            self.server = ControlServer(listen, self.secret, self.events)
        store.set("tandem/control", f"{self.config.master[0]}:{self.server.port}")

    def close(self) -> None:
        for node in self.nodes.values():
            if node.peer is not None:
                node.peer.close()
        if self.server is not None:
            self.server.close()

    # -- who is where ----------------------------------------------------------------------
    def live(self) -> set[int]:
        return {worker for node in self.nodes.values() for worker in node.workers}

    def remote_live(self) -> set[int]:
        return {worker for node in self.nodes.values() if node.peer is not None
                for worker in node.workers}

    def node_of(self, worker: int) -> Node | None:
        return next((node for node in self.nodes.values() if worker in node.workers), None)

    def gone(self, worker: int) -> Node | None:
        """The worker exited: free its slot; the node it ran on."""
        node = self.node_of(worker)
        if node is not None:
            del node.workers[worker]
        return node

    def slots(self) -> int:
        return sum(node.slots for node in self.nodes.values())

    # -- agents coming and going -------------------------------------------------------------
    def admit(self, joined: Joined) -> Node | None:
        """An authenticated agent said hello: its node, or None when it was turned away."""
        def slots(hello: dict) -> str | None:
            if isinstance(hello.get("nproc"), int) and hello["nproc"] >= 1:
                return None
            return f"it offers {hello.get('nproc')!r} slots: give it -np N (1 or more)"

        admitted = admit(joined, nnodes=self.config.nnodes, present=set(self.nodes),
                         elastic=True, events=self.events, lost_after=lost_after(self.config),
                         output=self.output, also=slots)
        if admitted is None:
            return None
        hello, peer = admitted
        node = Node(hello["node_rank"], str(hello.get("host", joined.where)), hello["nproc"], peer)
        self.nodes[node.number] = node
        self.output.message(f"tandem run: elastic: node {node.number} ({node.host}) joined "
                            f"with {node.slots} slot(s)")
        return node

    def lost(self, number: int) -> tuple[Node | None, list[int]]:
        """Node `number`'s agent is gone: forget the node; its workers, now lost with it."""
        node = self.nodes.pop(number, None)
        if node is None:
            return None, []
        if node.peer is not None:
            node.peer.close()
        return node, sorted(node.workers)

    def gather(self, timeout: float) -> Failure | None:
        """Before round 0: wait for every node, or for `START_WINDOW_S` once the nodes here
        offer --min-np slots; a `Failure` when too few come within `timeout` (or Ctrl-C)."""
        start = time.monotonic()
        enough_since = None
        low = self.config.min_np or 1
        while len(self.nodes) < self.expected:
            now = time.monotonic()
            if self.slots() >= low:
                enough_since = enough_since or now
                if now - enough_since >= START_WINDOW_S:
                    break
                wait = START_WINDOW_S - (now - enough_since)
            else:
                enough_since = None
                wait = timeout - (now - start)
                if wait <= 0:
                    missing = sorted(set(range(self.config.nnodes)) - set(self.nodes))
                    return Failure(node=missing[0], host="?", lost=(
                        f"too few nodes joined within {timeout:g} s: {self.slots()} slot(s), "
                        f"--min-np {low} needed (missing: node(s) "
                        f"{', '.join(map(str, missing))})"))
            try:
                event = self.events.get(timeout=max(0.0, wait))
            except queue.Empty:
                continue
            match event:
                case Signalled(signum):
                    return Failure(node=0, host=self.nodes[0].host, interrupt=signum)
                case Joined():
                    self.admit(event)
                case Rejected(where, why):
                    self.output.message(f"tandem run: rejected an agent from {where}: {why}")
                case Lost(node):
                    self.lost(node)
                    self.output.message(f"tandem run: node {node} left before the job started")
                case AgentExited(node, host, code) if node not in self.nodes:  # ssh failed?
                    self.expected -= 1
                    self.output.message(f"tandem run: the agent for {host} exited (code "
                                        f"{code}) before joining; the job starts without it")
        return None

    # -- talking to them ---------------------------------------------------------------------
    def send(self, node: Node, message: tuple) -> None:
        if node.peer is not None:
            node.peer.send(message)

    def tell_all(self, message: tuple) -> None:
        for node in self.nodes.values():
            self.send(node, message)

    def finish(self, code: int, summary: str | None) -> None:
        """Every agent exits with the job's code; let them read it and hang up first."""
        waiting = {node.number for node in self.nodes.values() if node.peer is not None
                   and node.peer.send(("finish", {"code": code, "summary": summary}))}
        await_hang_ups(self.events, waiting)
