"""Node 0's agent, the coordinator: runs a job in attempts, restarts it when a rank fails.

`tandem run --max-restarts K` and node 0 of a multi-node job use this agent (a plain
single-node job without restarts is `supervisor.LocalJob`). It hosts the rendezvous store for
the life of the job (every attempt gets key prefixes of its own through `TANDEM_RESTART`),
and, for a multi-node job, the control plane the other agents join (see `multinode`).

One attempt: node 0 tells every agent where its ranks sit (`ranks.Placement`), every agent
starts its ranks, and events come back on one queue: a rank's exit, a message from another
agent, a lost agent, a signal. `_Attempt` is the rank supervisor's loop
(`supervisor.Supervisor`) plus the other nodes: the first failure anywhere stops every rank on
every node (SIGTERM, then SIGKILL after `STOP_GRACE_S`). When everything is down, the attempt is over:

- every rank exited 0: the job succeeded;
- a rank failed and restarts are left: every agent prints the summary, and the job starts
  again from the top of the script with `TANDEM_RESTART=<attempt>` (`td.Checkpointer` or
  `td.load` continue from the last checkpoint);
- a node was lost (its link cut, its host gone) and restarts are left: the job goes on without
  it once another agent takes its place, with its node rank and its number of ranks: `-H`
  starts one on a host of the list that had no ranks (`on_lost`), a `--nnodes` job waits up to
  the timeout for one to be started by hand (or by the cluster's scheduler); the world keeps
  its size, so the job resumes from its checkpoint as after any restart;
- otherwise (no restarts left, a lost node nobody replaced, or a person pressed Ctrl-C): every
  agent prints the summary and exits with the failing rank's code (1 for a lost node, 128 + N
  for signal N).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time
from typing import TextIO

from tandem import rendezvous
from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents.admission import admit, await_hang_ups
from tandem.launch.agents.control import ControlServer, Peer, interface_of, reached_at
from tandem.launch.config import LaunchConfig
from tandem.launch.events import (
    AgentExited,
    Event,
    Joined,
    Lost,
    Message,
    Rejected,
    Signalled,
)
from tandem.launch.local.joined import JoinWatch
from tandem.launch.local.output import signals_blocked
from tandem.launch.local.processes import KILL_WAIT_S, STOP_GRACE_S, describe
from tandem.launch.local.ranks import Placement, free_port, new_run_id
from tandem.launch.local.supervisor import DRAIN_S, Agent, Failure, Supervisor, summary

REMOTE_STOP_S = STOP_GRACE_S + KILL_WAIT_S + 5.0  # how long other nodes may take to stop
# An agent silent this long (or the timeout, if shorter) is lost. The agents' heartbeats
# (`control.HEARTBEAT_S`) run in threads of their own, never behind a collective: eight missed
# beats name a pulled cable or a frozen host in about 4 s (was 30 s), and the job then moves
# on at once (elastic: the round without its workers; fixed: restart or end).
MAX_LOST_AFTER_S = 4.0


def lost_after(config: LaunchConfig) -> float:
    return min(config.timeout or DEFAULT_TIMEOUT_S, MAX_LOST_AFTER_S)


class Coordinator(Agent):
    """Node 0: the store, the control plane, the attempts; its own ranks if it has any."""

    def __init__(self, config: LaunchConfig, *, nproc: int, nnodes: int = 1,
                 store: tuple[str, int] = ("127.0.0.1", 0), secret: str | None = None,
                 gloo_interface: str | None = None, host: str = "localhost",
                 listen: str | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__(config, nproc=nproc, stdout=stdout, stderr=stderr)
        self.nproc, self.nnodes = nproc, nnodes
        self.store_address, self.secret, self.host = store, secret, host
        # where the store and the control plane listen; `store` is what everyone is told
        self.listen = listen or store[0]
        self.gloo_interface = gloo_interface
        self.peers: dict[int, Peer] = {}
        self.nprocs: dict[int, int] = {0: nproc}
        self.hosts: dict[int, str] = {0: host}
        self.reached: dict[int, str] = {}  # node -> the local address its agent came in at
        self.lost: set[int] = set()  # nodes whose agent went silent or away
        self.on_listening = None  # -H: starts the remote agents once the store port is known
        # -H: on_lost(node, nproc) starts an agent for a lost node on a spare host and returns
        # where, or None when no host is left; without it, a replacement is started by hand
        self.on_lost = None
        self.replacing: dict[int, int] = {}  # lost node -> the ranks its replacement must run
        # Whether the other agents print the job's notes and summary: on their own machines'
        # terminals, yes; -H agents' output comes back here over ssh, where it would be twice.
        self.echo_to_peers = True
        self.store = None
        self._server: ControlServer | None = None
        self.run_id = new_run_id()  # TORCHELASTIC_RUN_ID, the same on every node and attempt
        self.watch: JoinWatch | None = None  # whether a rank of the current attempt joined

    # -- the whole job --------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        for peer in self.peers.values():
            peer.close()
        if self._server is not None:
            self._server.close()
        if self.store is not None:
            self.store.close()

    def _run(self) -> int:
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S
        with signals_blocked():  # the store's and the listener's threads leave them to us
            key = rendezvous.store_key(self.secret) if self.secret else None  # None: a new one
            # An agent with the wrong secret is refused by the store first: report it as the
            # control plane would.
            refused = self._refused if self.nnodes > 1 else None
            self.store = rendezvous.StoreServer(self.listen, self.store_address[1], key, refused)
            if self.nnodes > 1:
                self._server = ControlServer(self.listen, self.secret, self.events)
        port = self.store.port
        if self._server is not None:
            self.store.set("tandem/control", f"{self.store_address[0]}:{self._server.port}")
            if self.on_listening is not None:
                self.on_listening(port)
            failure = self._gather(timeout)
            if failure is not None:
                return self._finish(failure)
            self._point_gloo_at_the_others()
        offsets, start = {}, 0
        for node in sorted(self.nprocs):
            offsets[node], start = start, start + self.nprocs[node]
        world = start
        attempts = self.config.max_restarts + 1
        for attempt in range(attempts):
            failure = self._attempt(attempt, offsets, world, port)
            if failure is None:
                if attempt:
                    self.output.message(f"tandem run: the job succeeded after {attempt} "
                                        f"restart(s)")
                return self._finish(None, code=self.independent_copies(self.watch))
            tries = f" (attempt {attempt + 1} of {attempts})" if attempts > 1 else ""
            last = attempt + 1 == attempts
            replaceable = failure.lost is not None and not last
            if not replaceable and (not failure.restartable or last):
                return self._finish(failure, tries)
            self._say(summary(failure, tries))
            if replaceable:
                unreplaced = self._replace(failure, timeout)
                if unreplaced is not None:
                    return self._finish(unreplaced, tries)
            self._say(f"tandem run: restarting the whole job: attempt {attempt + 2} of "
                      f"{attempts}, TANDEM_RESTART={attempt + 1}")
        raise AssertionError("unreachable")

    def _say(self, text: str) -> None:
        """Print on this node, and on the others' terminals when they have their own."""
        self.output.message(text)
        for peer in self.peers.values() if self.echo_to_peers else ():
            peer.send(("note", {"text": text}))

    def _replace(self, failure: Failure, timeout: float) -> Failure | None:
        """Let another agent take the lost node's place (same node rank, same number of
        ranks); None once one has joined, else the failure that ends the job."""
        node, nproc = failure.node, self.nprocs.get(failure.node, 1)
        self.peers.pop(node, None)
        self.nprocs.pop(node, None)
        self.reached.pop(node, None)
        self.replacing[node] = nproc
        if self.on_lost is not None:
            where = self.on_lost(node, nproc)
            if where is None:
                return dataclasses.replace(failure, lost=(
                    f"{failure.lost}; no host of -H/--hostfile is left to take its place "
                    f"(one without ranks and with {nproc} slot(s) or more)"))
            self._say(f"tandem run: node {node} goes on at {where}: starting its agent there")
        else:
            self._say(
                f"tandem run: waiting up to {timeout:g} s for an agent to take node {node}'s "
                f"place: `tandem run --nnodes {self.nnodes} --node-rank {node} --master ... "
                f"-np {nproc}` on another machine")
        unjoined = self._gather(timeout)
        if unjoined is not None:
            if unjoined.lost is None:  # Ctrl-C while waiting
                return unjoined
            return dataclasses.replace(failure, lost=f"{failure.lost}; then {unjoined.lost}")
        del self.replacing[node]
        self.lost.discard(node)
        return None

    def _finish(self, failure: Failure | None, attempts: str = "", code: int = 0) -> int:
        text = summary(failure, attempts) if failure is not None else None
        code = failure.code if failure is not None else code
        waiting = {node for node, peer in self.peers.items()
                   if peer.send(("finish", {"code": code,
                                            "summary": text if self.echo_to_peers else None}))}
        if text:
            self.output.message(text)
        await_hang_ups(self.events, waiting)
        return code

    # -- joining ---------------------------------------------------------------------------
    def _point_gloo_at_the_others(self) -> None:
        """Node 0's ranks use the interface the other agents reached it through: the route to
        the master's name can be loopback here (`127.0.1.1 node0` in /etc/hosts) even where
        the others reach node 0 over the network."""
        if "GLOO_SOCKET_IFNAME" in os.environ:
            return
        for node in sorted(self.reached):
            interface = interface_of(self.reached[node])
            if interface is not None and interface != "lo":
                self.gloo_interface = interface
                return

    def _refused(self, where: str, why: str) -> None:
        self.events.put(Rejected(where, why))

    def _gather(self, timeout: float) -> Failure | None:
        """Wait until every other node's agent has joined (authenticated, valid node rank)."""
        deadline = time.monotonic() + timeout
        rejected: list[str] = []
        while len(self.nprocs) < self.nnodes:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.nnodes)) - set(self.nprocs))
                extra = f"; rejected: {'; '.join(rejected)}" if rejected else ""
                return Failure(node=missing[0], host="?", lost=(
                    f"its agent did not join within {timeout:g} s (missing: node(s) "
                    f"{', '.join(map(str, missing))}){extra}. Start `tandem run --nnodes "
                    f"{self.nnodes} --node-rank R --master ADDR:PORT --secret ...` on each node"))
            match event:
                case Signalled(signum):
                    return Failure(node=0, host=self.host, interrupt=signum)
                case AgentExited(node, host, code) if node not in self.nprocs:  # ssh failed?
                    return Failure(node=node, host=host, lost=(
                        f"its agent exited (code {code}) before joining; can this machine ssh "
                        f"to {host} without a password, with tandem installed at the same "
                        f"path?"))
                case Rejected(where, reason):
                    rejected.append(f"{where}: {reason}")
                    self.output.message(f"tandem run: rejected an agent from {where}: {reason}")
                case Joined():
                    self._admit(event)
                case Lost(node):
                    self._left(node)
        return None

    def _left(self, node: int) -> None:
        self.peers.pop(node, None)
        self.nprocs.pop(node, None)
        self.reached.pop(node, None)
        self.output.message(f"tandem run: node {node} left before the job started")

    def _admit(self, joined: Joined) -> None:
        def same_share(hello: dict) -> str | None:  # a lost node's replacement
            node, nproc = hello["node_rank"], hello.get("nproc")
            if node in self.replacing and nproc != self.replacing[node]:
                return (f"it would run {nproc} rank(s) in place of node {node}, which ran "
                        f"{self.replacing[node]}: give it -np {self.replacing[node]}")
            return None

        admitted = admit(joined, nnodes=self.nnodes, present=set(self.nprocs), elastic=False,
                         events=self.events, lost_after=lost_after(self.config),
                         output=self.output, also=same_share)
        if admitted is None:
            return
        hello, peer = admitted
        node = hello["node_rank"]
        self.peers[node] = peer
        self.nprocs[node] = int(hello["nproc"])
        self.hosts[node] = str(hello.get("host", joined.where))
        address = reached_at(joined.conn)
        if address is not None:
            self.reached[node] = address

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, attempt: int, offsets: dict, world: int, port: int) -> Failure | None:
        host = self.store_address[0]
        # torchrun's rendezvous (rank 0's TCPStore, on this node): a fresh port per attempt.
        torch = {"torch_port": free_port(), "run_id": self.run_id, "nodes": len(self.nprocs)}
        for node, peer in self.peers.items():
            peer.send(("start", {"attempt": attempt, "offset": offsets[node], "world": world,
                                 "store": (host, port), "node": node, **torch}))
        # Every rank that joins says so to the store here (`launch.local.joined`), on any node.
        self.watch = JoinWatch(self.store)
        self.ranks.start(Placement(attempt, offsets[0], world, (host, port), self.store.key,
                                   self.gloo_interface, node=0, **torch))
        run = _Attempt(self, attempt, offsets)
        run.run()
        self.output.join(DRAIN_S)
        failure = run.failure
        if failure is not None and failure.rank is not None:
            tail = (self.output.tail(failure.rank) if failure.node == 0
                    else run.tails.get(failure.rank, ()))
            failure = dataclasses.replace(failure, tail=tuple(tail))
        return failure


class _Attempt(Supervisor):
    """One attempt as node 0 sees it: its own ranks, and the other nodes until they are done."""

    kill_wait = REMOTE_STOP_S  # after SIGKILL here: the other nodes stop too

    def __init__(self, job: Coordinator, attempt: int, offsets: dict[int, int]) -> None:
        super().__init__(job.ranks, job.events, job.output, node=0, host=job.host)
        self.job, self.attempt, self.offsets = job, attempt, offsets
        self.running = set(job.peers)  # other nodes whose ranks have not all ended
        self.tails: dict[int, tuple[str, ...]] = {}

    def stop(self, failure: Failure | None, signum: int = signal.SIGTERM) -> None:
        """The first failure: stop every rank here and on every other node."""
        if not self.stopping:
            for node in self.running:
                self.job.peers[node].send(("stop", {"attempt": self.attempt}))
        super().stop(failure, signum)

    def others_running(self) -> bool:
        return bool(self.running)

    def give_up(self) -> None:
        self.output.message(f"tandem run: giving up on ranks {sorted(self.ranks.live)} and "
                            f"nodes {sorted(self.running)} that did not stop")

    def rank_exited(self, rank: int, returncode: int) -> None:
        if self.failure is None:
            self.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                "stopping every rank of the job")
            self.stop(self.rank_failure(rank, returncode))

    def other(self, event: Event) -> None:
        job = self.job
        if isinstance(event, Lost):
            node = event.node
            self.running.discard(node)
            job.lost.add(node)
            first = self.offsets.get(node, 0)
            lost = Failure(node=node, host=job.hosts.get(node, "?"), lost=event.why,
                           ranks=(first, first + job.nprocs.get(node, 1) - 1))
            job.output.message(f"tandem run: {lost.headline()}; stopping the job")
            if self.failure is None:
                self.stop(lost)
            elif self.failure.restartable:
                self.failure = lost  # a job without that node cannot be restarted
        elif isinstance(event, Message):
            self._message(event.node, event.kind, event.body)
        elif isinstance(event, Joined):
            try:  # the job has all its nodes
                event.conn.send(("refused", {"reason": "the job is running with all its nodes"}))
            except OSError:
                pass
            event.conn.close()

    def _message(self, node: int, kind: str, body: dict) -> None:
        if body.get("attempt", self.attempt) != self.attempt:
            return  # a late word about an earlier attempt
        host = self.job.hosts.get(node, "?")
        if kind == "exit" and self.failure is None:
            self.job.output.message(
                f"tandem run: rank {body['rank']} on node {node} failed: "
                f"{describe(body['returncode'])}; stopping every rank of the job")
            self.stop(Failure(node=node, host=host, rank=body["rank"], pid=body.get("pid"),
                              returncode=body["returncode"]))
        elif kind == "done":
            self.running.discard(node)
            self.tails.update({int(r): tuple(t) for r, t in body.get("tails", {}).items()})
        elif kind == "interrupted" and self.failure is None:
            self.stop(Failure(node=node, host=host, interrupt=body["signum"]))
