"""Node 0's table of the job's machines, fixed job or elastic: its own, and the agents that
joined over the control plane, with their slots and the ranks (workers) live in them.

`Nodes` lets the other agents in (`gather` before the first attempt or round, `admit`: the
checks of `admission`, plus a lost node's replacement running as many ranks as it did), knows
who runs where (`live`, `node_of`, `gone`), talks to them (`send`, `tell_all`) and ends the
job on all of them (`finish`). A fixed job waits for every node; an elastic one, once the nodes
there offer `--min-np` slots, waits `START_WINDOW_S` more and starts with those.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents.admission import refusal, refuse, unwrap_hello
from tandem.launch.agents.control import Peer, reached_at
from tandem.launch.config import LaunchConfig
from tandem.launch.events import AgentExited, Joined, Lost, Rejected, Signalled
from tandem.launch.local.output import RankOutput
from tandem.launch.local.supervisor import Failure

FINISH_S = 5.0  # how long node 0 waits for the other agents to hang up at the end
START_WINDOW_S = 3.0  # elastic: with --min-np slots there, how long node 0 waits for the others
# An agent silent this long (or the timeout, if shorter) is lost. The agents' heartbeats
# (`control.HEARTBEAT_S`) run in threads of their own, never behind a collective: eight missed
# beats name a pulled cable or a frozen host in about 4 s (was 30 s), and the job then moves
# on at once (elastic: the round without its workers; fixed: restart or end).
MAX_LOST_AFTER_S = 4.0


def lost_after(config: LaunchConfig) -> float:
    return min(config.timeout or DEFAULT_TIMEOUT_S, MAX_LOST_AFTER_S)


@dataclass
class Node:
    """One machine of the job as node 0 sees it: its slots and the live workers in them."""

    number: int
    host: str
    slots: int  # a fixed job: the ranks it runs (its -np)
    peer: Peer | None = None  # None: node 0 itself
    workers: dict[int, int] = field(default_factory=dict)  # live worker id -> its local slot
    reached: str | None = None  # the local address its agent came in at

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
                 secret: str | None, *, nnodes: int, nproc: int, host: str,
                 expected: int | None = None) -> None:
        self.config, self.events, self.output = config, events, output
        self.secret, self.nnodes, self.elastic = secret, nnodes, config.elastic
        self.expected = expected or nnodes  # how many nodes the first round or attempt waits for
        self.nodes = {0: Node(0, host, nproc)}
        self.replacing: dict[int, int] = {}  # lost node -> the ranks its replacement must run

    @property
    def several(self) -> bool:
        return self.nnodes > 1

    def close(self) -> None:
        for node in self.nodes.values():
            if node.peer is not None:
                node.peer.close()

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

    def placement(self, most: int | None = None) -> dict[int, tuple[int, int]]:
        """Where a job starts (a fixed attempt, an elastic round 0): the ranks fill the nodes
        in order, each its slots, `most` in all; node -> (its first global rank, its count)."""
        placed, first, left = {}, 0, self.slots() if most is None else most
        for number in sorted(self.nodes):
            count = min(self.nodes[number].slots, left)
            placed[number], first, left = (first, count), first + count, left - count
        return placed

    # -- agents coming and going -------------------------------------------------------------
    def _check(self, hello: dict) -> str | None:
        """The job's own check of a hello: an elastic node offers slots; a lost node's
        replacement runs as many ranks as it did."""
        node, nproc = hello["node_rank"], hello.get("nproc")
        if self.elastic and not (isinstance(nproc, int) and nproc >= 1):
            return f"it offers {nproc!r} slots: give it -np N (1 or more)"
        if node in self.replacing and nproc != self.replacing[node]:
            return (f"it would run {nproc} rank(s) in place of node {node}, which ran "
                    f"{self.replacing[node]}: give it -np {self.replacing[node]}")
        return None

    def admit(self, joined: Joined) -> Node | None:
        """An authenticated agent said hello: its node, or None when it was turned away (told
        why, and said here): `admission.refusal`, then the job's own check (`_check`)."""
        hello = unwrap_hello(joined.hello)
        reason = refusal(hello, self.nnodes, set(self.nodes), elastic=self.elastic,
                         job=self.config.job_id) or self._check(hello)
        if reason is not None:
            refuse(joined.conn, reason, joined.where, self.output)
            return None
        peer = Peer(joined.conn, hello["node_rank"], self.events, lost_after(self.config))
        peer.start()
        node = Node(hello["node_rank"], str(hello.get("host", joined.where)),
                    int(hello["nproc"]), peer, reached=reached_at(joined.conn))
        self.nodes[node.number] = node
        if self.elastic:
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
        """Before the first attempt or round (and for a lost node's replacement): wait for
        every node; an elastic job, once the nodes here offer --min-np slots, for
        `START_WINDOW_S` more. A `Failure` when too few come within `timeout` (or Ctrl-C)."""
        start = time.monotonic()
        enough_since = None
        low = self.config.min_np or 1
        rejected: list[str] = []
        while len(self.nodes) < self.expected:
            now = time.monotonic()
            wait = timeout - (now - start)
            if self.elastic and self.slots() >= low:
                enough_since = enough_since or now
                if now - enough_since >= START_WINDOW_S:
                    break
                wait = START_WINDOW_S - (now - enough_since)
            else:
                enough_since = None
                if wait <= 0:
                    return self._too_few(timeout, rejected)
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
                    rejected.append(f"{where}: {why}")
                    self.output.message(f"tandem run: rejected an agent from {where}: {why}")
                case Lost(node):
                    self.lost(node)
                    self.output.message(f"tandem run: node {node} left before the job started")
                case AgentExited(node, host, code) if node not in self.nodes:  # ssh failed?
                    if not self.elastic:
                        return Failure(node=node, host=host, lost=(
                            f"its agent exited (code {code}) before joining; can this machine "
                            f"ssh to {host} without a password, with tandem installed at the "
                            f"same path?"))
                    self.expected -= 1
                    self.output.message(f"tandem run: the agent for {host} exited (code "
                                        f"{code}) before joining; the job starts without it")
        return None

    def _too_few(self, timeout: float, rejected: list[str]) -> Failure:
        missing = sorted(set(range(self.nnodes)) - set(self.nodes))
        nodes = ", ".join(map(str, missing))
        if self.elastic:
            return Failure(node=missing[0], host="?", lost=(
                f"too few nodes joined within {timeout:g} s: {self.slots()} slot(s), "
                f"--min-np {self.config.min_np or 1} needed (missing: node(s) {nodes})"))
        extra = f"; rejected: {'; '.join(rejected)}" if rejected else ""
        return Failure(node=missing[0], host="?", lost=(
            f"its agent did not join within {timeout:g} s (missing: node(s) {nodes}){extra}. "
            f"Start `tandem run --nnodes {self.nnodes} --node-rank R --master ADDR:PORT "
            f"--secret ...` on each node"))

    # -- talking to them ---------------------------------------------------------------------
    def send(self, node: Node, message: tuple) -> bool:
        return node.peer is not None and node.peer.send(message)

    def tell_all(self, message: tuple) -> set[int]:
        """Send `message` to every other agent; the nodes it reached."""
        return {node.number for node in self.nodes.values() if self.send(node, message)}

    def finish(self, code: int, summary: str | None) -> None:
        """Every agent exits with the job's code. Let them read it and hang up first (closing a
        socket with unread input resets the connection, which could lose the message), for at
        most `FINISH_S`."""
        waiting = self.tell_all(("finish", {"code": code, "summary": summary}))
        deadline = time.monotonic() + FINISH_S
        while waiting:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if isinstance(event, Lost):
                waiting.discard(event.node)


__all__ = ["MAX_LOST_AFTER_S", "Node", "Nodes", "START_WINDOW_S", "lost_after"]
