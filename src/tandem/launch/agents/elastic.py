"""`tandem run --min-np A --max-np B`: a job that goes on when ranks fail and grows when it can.

The agent hosts the store and starts `-np` ranks, each a *worker* with an id of its own for
the life of its process. Who forms the world is a *round* on the store
(`rendezvous.elastic_rounds`): the workers in rank order. The rank supervisor's loop
(`supervisor.Supervisor`) watches them, with two differences:

- a rank that fails does not stop the others: the agent publishes the next round without it,
  and the survivors (`tandem.elastic.run`) leave the broken world at the failure, join the new
  round, take the last committed state from one of them and go on. Below `--min-np` survivors
  the job ends like any failed job, with the summary naming the first rank that failed;
- `--host-discovery-script` is run every `DISCOVERY_S` seconds; when it offers more slots
  than there are ranks (up to `--max-np`), the agent starts new workers in a new round, and the
  ranks move to it at their next `State.commit()`.

Every transition is one line: the old and new world and why. A rank that exits 0 means the
job is finishing: no round changes after that, and a failure then ends the job. The end is an
event like the others: once every worker that trained to the end has exited, workers that
came too late (still starting, or in a round the finished ones never entered) are stopped,
and the job ends with the finished workers' code (`policies.Elastic.late`).

`Rounds` is the elastic policy of the one agent, node 0's `coordinator.Coordinator` (a fixed
job is the case min = max, restarted whole instead): the coordinator hosts the store and the
control plane, admits the other agents (`nodes.Nodes`) and ends the job; `Rounds` runs its one
attempt in rounds. Across machines (`--nnodes`, `-H`), the workers of the other nodes' agents
(`member.Member`) are in its rounds too, their exits come as messages, a lost node takes its
workers with it in one round, and a node that joins grows the job like a discovered slot:

    node0$ tandem run --nnodes 3 --node-rank 0 --master 10.0.0.1:29500 --min-np 2 --max-np 6 \\
               -np 2 train.py
    node1$ tandem run --nnodes 3 --node-rank 1 --master 10.0.0.1:29500 --secret S \\
               --min-np 2 --max-np 6 -np 2 train.py

`-np` is each machine's number of slots, `--min-np/--max-np` the whole job's range of ranks and
`--nnodes` the most machines. At the start node 0 waits for every node, or, once the nodes
joined offer `--min-np` slots, for `nodes.START_WINDOW_S` more; round 0 is formed from the
machines there (up to `--max-np`). With -H (`multinode.launch_hosts`), this machine, the first
host of the list, is node 0 and starts an agent over ssh on every other host that gets ranks;
with `--host-discovery-script`, a listed host that runs no agent (a new one, or one whose agent
was lost) gets one under the lowest free node rank, and node 0's own line sets its slots. A
host whose agent is lost leaves the job (one round without its ranks) until the script lists it
again.
"""

from __future__ import annotations

import threading
import time

from tandem import rendezvous
from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents.discovery import discover
from tandem.launch.agents.nodes import Node
from tandem.launch.events import SlotsOffered, WorkersReady
from tandem.launch.local.output import block_agent_signals, signals_blocked
from tandem.launch.local.ranks import Placement
from tandem.launch.local.supervisor import Supervisor
from tandem.rendezvous.elastic_rounds import (
    Round,
    publish,
    ready_key,
    report_death,
    silent_key,
)

DISCOVERY_S = 1.0  # how often --host-discovery-script runs


class Rounds:
    """An elastic job's attempt, run in rounds for node 0's agent `job` (the coordinator: its
    store, its nodes, its ranks)."""

    def __init__(self, job) -> None:
        self.job, config = job, job.config
        self.low, self.high = config.min_np or 1, config.max_np or config.np
        self.nodes, self.ranks, self.output = job.nodes, job.ranks, job.output
        self.agents = None  # -H: the agents this machine starts (`ssh.HostAgents`)
        self.discovery = config.discovery  # (-H: given here, the agents' configs have none)
        self.round: Round | None = None
        self.next_worker = 0
        self.pending: set[int] = set()  # started, not yet in a round (`grow`, `admit`)
        self.first_round: dict[int, int] = {}  # worker -> the first round that included it

    @property
    def store(self) -> rendezvous.StoreServer:
        return self.job.store

    def start(self) -> Supervisor:
        """Round 0 on the nodes there now, discovery and the watch for silent ranks; the watch
        over them."""
        self.begin()
        if self.discovery is not None:
            with signals_blocked():
                threading.Thread(target=self._discover, name="tandem-discovery",
                                 daemon=True).start()
        self.job.watch_silent(silent_key, lambda told: self.round.number)
        return Supervisor(self.ranks, self.job.events, self.output, rounds=self)

    # -- rounds ----------------------------------------------------------------------------
    def publish(self, workers: list[int], why: str, since: float) -> Round:
        number = 0 if self.round is None else self.round.number + 1
        old = 0 if self.round is None else self.round.size
        self.round = Round(number, tuple(workers), why, since)
        for worker in workers:
            self.first_round.setdefault(worker, number)
        publish(self.store, self.round)
        if number:
            self.output.message(f"tandem run: elastic: world {old} -> {len(workers)} "
                                f"(round {number}): {why}")
        return self.round

    def _place(self, node: Node, count: int, first_rank: int, size: int, number: int) -> list[int]:
        """Start `count` new workers on `node` as ranks `first_rank`, ...; their ids."""
        workers = list(range(self.next_worker, self.next_worker + count))
        self.next_worker += count
        self.job.start_on(node, workers, node.free_slots(count),
                          Placement(0, first_rank, size, self.job.store_address, self.store.key,
                                    self.job.gloo_interface), number)
        return workers

    def begin(self) -> None:
        """The job's first workers, on the nodes there now (node 0's first): round 0."""
        placed = self.nodes.placement(self.high)
        size = sum(count for _, count in placed.values())
        self.publish(list(range(size)), "start", time.time())
        for number, (first, count) in placed.items():
            if count:
                self._place(self.nodes.nodes[number], count, first, size, 0)

    def grow(self, node: Node, count: int) -> None:
        """Start `count` new workers on `node`; their round is formed once they are ready
        (`admit`)."""
        first = len(self.nodes.live())
        new = self._place(node, count, first, first + count, -1)
        self.pending.update(new)
        keys = [ready_key(worker) for worker in new]
        timeout = self.job.config.timeout or DEFAULT_TIMEOUT_S

        def wait_ready() -> None:
            block_agent_signals()
            if self.store.wait_for(keys, timeout):
                self.job.events.put(WorkersReady(tuple(new)))

        threading.Thread(target=wait_ready, name="tandem-elastic-ready", daemon=True).start()

    def admit(self, workers: tuple[int, ...], why: str) -> None:
        """The new workers reached td.init(): the round that adds those still alive."""
        live = self.nodes.live()
        joining = [w for w in workers if w in self.pending and w in live]
        self.pending.difference_update(workers)
        if joining:
            staying = [w for w in self.round.workers if w in live]
            self.publish(staying + joining, why, time.time())

    def shrink(self, gone: dict[int, str], why: str) -> Round | None:
        """The round without the `gone` workers (worker -> how it went, "exit code 9"); None
        when too few would be left."""
        for worker, how in gone.items():
            rank = self.round.rank_of(worker)
            if rank is not None:
                report_death(self.store, self.round.number, rank, how)
        live = self.nodes.live()
        staying = [w for w in self.round.workers if w in live]
        if len(staying) < self.low:
            return None
        return self.publish(staying, why, time.time())

    # -- discovery -------------------------------------------------------------------------
    def _discover(self) -> None:
        said = None  # a bad run is named once, until the script offers slots again
        while not self.job.attempt_over.wait(DISCOVERY_S):
            slots, problem = discover(self.discovery, self.job.config.discovery_timeout)
            if problem is not None and problem != said:
                self.output.message(f"tandem run: --host-discovery-script {self.discovery}: "
                                    f"{problem}; the job goes on with the hosts it has")
            said = problem
            if slots is not None:
                self.job.events.put(SlotsOffered(slots))

