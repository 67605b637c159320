"""Node 0's agent, the coordinator, of every job that agents run: restarts, several nodes,
-H/--hostfile hosts, elastic ranges. One agent, as torchrun's: a fixed job is an elastic job
whose size cannot change (min = max).

Every `tandem run` job that mpiexec does not start uses this agent: a plain local job (one
machine, no restarts: the case nnodes = 1, restarts = 0, min = max), `--max-restarts K`,
`--nnodes` (node 0), `-H` and every `--min-np/--max-np` job; a `--backend mpi` job's ranks are
started by mpiexec (`mpiexec.MPIExecRanks`) under the same agent, an elastic one's
(`shrinking.ShrinkingRanks`) with a world that shrinks in place (the watch's `low`). It hosts the
rendezvous store for the life of the job (every attempt gets key prefixes of its own through
`TANDEM_RESTART`), and, across machines, the control plane the other agents join
(`member.Member`; `nodes.Nodes` is node 0's table of them).

The job runs in attempts (`_run`): every agent starts its ranks, and events come back on one
queue: a rank's exit, a message from another agent, a lost agent, a signal. The watch over one
attempt is the job's policy:

- a fixed job (`supervisor.Supervisor`): the first failure anywhere stops every rank on every
  node (SIGTERM, then SIGKILL after `STOP_GRACE_S`);
- an elastic job (`elastic.Rounds`): a failure shrinks the job to the survivors in a new round
  while they are `--min-np` or more, and new slots grow it; only below `--min-np` (or at the
  job's end) does the attempt stop.

When everything is down, the attempt is over:

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
import json
import os
import signal
import socket
import threading
from functools import partial
from typing import TextIO

from tandem import rendezvous
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.job.settings import DEFAULT_TIMEOUT_S
from tandem.launch.agents import control
from tandem.launch.agents.nodes import Node, Nodes
from tandem.launch.config import LaunchConfig
from tandem.launch.events import Rejected, SilentRanks
from tandem.launch.local.joined import JoinWatch
from tandem.launch.local.output import block_agent_signals, signals_blocked
from tandem.launch.local.ranks import MASTER_ADDR, LocalRanks, Placement, free_port, new_run_id
from tandem.launch.local.supervisor import (
    DRAIN_S,
    Agent,
    Failure,
    StartInterrupted,
    Supervisor,
    silent_ranks,
    summary,
)

SILENT_POLL_S = 0.25  # how often the agent looks whether a rank named a silent peer


class Coordinator(Agent):
    """Node 0: the store, the control plane, the attempts; its own ranks if it has any.

    `rounds` makes it elastic: a class (`elastic.Rounds`) that, given the coordinator, runs an
    attempt in rounds; None, a job of a fixed size."""

    def __init__(self, config: LaunchConfig, *, nproc: int, nnodes: int = 1,
                 store: tuple[str, int] = (MASTER_ADDR, 0), secret: str | None = None,
                 gloo_interface: str | None = None, host: str | None = None,
                 listen: str | None = None, expected_nodes: int | None = None,
                 rounds: type | None = None, ranks: type[LocalRanks] = LocalRanks,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__(config, ranks=ranks, nproc=nproc, stdout=stdout, stderr=stderr)
        self.store_address, self.secret = store, secret  # `store`: what everyone is told
        self.host = host or socket.gethostname()
        self.listen = listen or store[0]  # where the store and the control plane listen
        self.gloo_interface = gloo_interface
        self.nodes = Nodes(config, self.events, self.output, secret, nnodes=nnodes,
                           nproc=nproc, host=self.host, expected=expected_nodes)
        self.on_listening = None  # -H: starts the remote agents once the store port is known
        # -H: on_lost(node, nproc) starts an agent for a lost node on a spare host and returns
        # where, or None when no host is left; without it, a replacement is started by hand
        self.on_lost = None
        # Whether the other agents print the job's notes and summary: on their own machines'
        # terminals, yes; -H agents' output comes back here over ssh, where it would be twice.
        self.echo_to_peers = True
        self.store: rendezvous.StoreServer | None = None
        self.run_id = new_run_id()  # TORCHELASTIC_RUN_ID, the same on every node and attempt
        self.watch: JoinWatch | None = None  # whether a rank of the current attempt joined
        self.preempted: set[int] = set()  # ranks of the last attempt that exited preempted
        self.shrunk: str | None = None  # an elastic MPI job's line naming the ranks it lost
        self.attempt_over = threading.Event()  # set once the current attempt is over
        self.rounds = rounds(self) if rounds is not None else None
        # A plain local job (one machine, no restarts, a fixed size) names no node in what it
        # says, and a rank that saved and exited EXIT_PREEMPTED ends it preempted.
        self.plain = nnodes == 1 and not config.max_restarts and rounds is None

    # -- the whole job --------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self.nodes.close()
        if self.store is not None:
            self.store.close()

    def open_store(self) -> None:
        """The store the job lives on; across nodes, the other agents join at its port too
        (the store hands their connections over: `control.greet`)."""
        several = self.nodes.several
        with signals_blocked():  # the store's threads leave them to us
            key = rendezvous.store_key(self.secret) if self.secret else None  # None: a new one
            # An agent with the wrong secret is refused by the store first: report it as the
            # control plane would.
            refused = (lambda where, why: self.events.put(Rejected(where, why))) if several \
                else None
            greet = partial(control.greet, secret=self.secret, events=self.events)
            self.store = rendezvous.StoreServer(self.listen, self.store_address[1], key, refused,
                                                greet if several else None)
        self.store_address = (self.store_address[0], self.store.port)
        if several and self.on_listening is not None:
            self.on_listening(self.store.port)

    def _run(self) -> int:
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S
        self.open_store()
        if self.nodes.several:
            failure = self.nodes.gather(timeout)
            if failure is not None:
                return self._finish(failure)
            self._point_gloo_at_the_others()
        attempts = self.config.max_restarts + 1  # elastic: 1 (it goes on instead)
        for attempt in range(attempts):
            failure = self._attempt(attempt)
            if self.plain:
                return self._plain_end(failure)
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

    def _plain_end(self, failure: Failure | None) -> int:
        """A plain local job's code: 0, the first failing rank's (its summary said), 128 + N
        after signal N (one line when every rank was still starting), or EXIT_PREEMPTED."""
        if self.preempted and (failure is None or failure.interrupt is not None):
            self.output.message(f"tandem run: preempted: rank(s) {sorted(self.preempted)} saved "
                                f"at the step they agreed on; exit {EXIT_PREEMPTED} (resume me: "
                                f"the next run restores the checkpoint)")
            return EXIT_PREEMPTED
        if failure is not None and failure.startup:
            self.output.message(f"tandem run: interrupted during start-up "
                                f"({signal.Signals(failure.interrupt).name}); stopped "
                                f"{self.config.np} rank(s)")
        if failure is None:
            if self.shrunk:
                self.output.message(self.shrunk)
            return self.independent_copies(self.watch)
        if failure.interrupt is None:
            self.output.message(summary(failure))
        return failure.code

    def _say(self, text: str) -> None:
        """Print on this node, and on the others' terminals when they have their own."""
        self.output.message(text)
        if self.echo_to_peers:
            self.nodes.tell_all(("note", {"text": text}))

    def _replace(self, failure: Failure, timeout: float) -> Failure | None:
        """Let another agent take the lost node's place (same node rank, same number of
        ranks); None once one has joined, else the failure that ends the job."""
        node, (first, last) = failure.node, failure.ranks
        nproc = last - first + 1
        self.nodes.replacing[node] = nproc
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
                f"place: `tandem run --nnodes {self.nodes.nnodes} --node-rank {node} --master "
                f"... -np {nproc}` on another machine")
        unjoined = self.nodes.gather(timeout)
        if unjoined is not None:
            if unjoined.lost is None:  # Ctrl-C while waiting
                return unjoined
            return dataclasses.replace(failure, lost=f"{failure.lost}; then {unjoined.lost}")
        del self.nodes.replacing[node]
        return None

    def _finish(self, failure: Failure | None, attempts: str = "", code: int = 0) -> int:
        """Every agent prints the summary and exits with the job's code (an elastic job says
        nothing more when a person stopped it)."""
        quiet = failure is None or (self.rounds is not None and failure.interrupt is not None)
        text = None if quiet else summary(failure, attempts)
        code = failure.code if failure is not None else code
        if text:
            self.output.message(text)
        self.nodes.finish(code, text if self.echo_to_peers else None)
        return code

    def _point_gloo_at_the_others(self) -> None:
        """Node 0's ranks (a fixed attempt's or an elastic round's) use the interface the other
        agents reached it through: the route to the master's name can be loopback here
        (`127.0.1.1 node0` in /etc/hosts) even where the others reach node 0 over the network."""
        if "GLOO_SOCKET_IFNAME" in os.environ:
            return
        for number in sorted(self.nodes.nodes):
            reached = self.nodes.nodes[number].reached
            interface = control.interface_of(reached) if reached is not None else None
            if interface is not None and interface != "lo":
                self.gloo_interface = interface
                return

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, attempt: int) -> Failure | None:
        """One attempt (an elastic job's only one, in rounds): its first failure, or None."""
        self.attempt_over = threading.Event()
        try:
            run = self.rounds.start() if self.rounds is not None else self._start(attempt)
        except StartInterrupted as interrupt:  # not all started: nothing to wait for
            return Failure(interrupt=interrupt.signum, startup=True)
        try:
            run.run()
        finally:
            self.attempt_over.set()
            if self.rounds is not None:
                self.ranks.reap()
        self.preempted, self.shrunk = run.preempted, run.shrunk(self.config.np)
        self.output.join(DRAIN_S)
        failure = run.failure
        if failure is not None and failure.rank is not None:
            here = failure.node in (None, 0)
            tail = self.output.tail(failure.rank) if here else failure.tail
            silent = silent_ranks(self.output, self.config.np) if here else ()
            failure = dataclasses.replace(failure, tail=tuple(tail), silent=silent)
        return failure

    def _start(self, attempt: int) -> Supervisor:
        """A fixed job's attempt: every node starts its share of the ranks, in node order;
        node 0's watch."""
        # torchrun's rendezvous (rank 0's TCPStore, on this node): a fresh port per attempt.
        torch = {"torch_port": free_port(), "run_id": self.run_id, "nodes": len(self.nodes.nodes)}
        # Every rank that joins says so to the store here (`launch.local.joined`), on any node.
        self.watch = JoinWatch(self.store)
        world = self.nodes.slots()
        for number, (first, count) in self.nodes.placement().items():
            node = self.nodes.nodes[number]
            node.workers.clear()
            self.start_on(node, list(range(first, first + count)), list(range(count)),
                          Placement(attempt, first, world, self.store_address, self.store.key,
                                    self.gloo_interface, node=number, **torch))
        if self.plain:  # an elastic MPI job's world shrinks in place, down to --min-np
            low = (self.config.min_np or 1) if self.config.elastic else None
            if low is not None and self.ranks.silent_key is not None:
                self.watch_silent(self.ranks.silent_key, lambda told: (told or 0) + 1)
            return Supervisor(self.ranks, self.events, self.output, low=low)
        return Supervisor(self.ranks, self.events, self.output, node=0, host=self.host,
                          nodes=self.nodes)

    def watch_silent(self, key, number) -> None:
        """Post a `SilentRanks` event for each report, on the store, of ranks that did not
        answer the watchdog of a rank whose wait timed out (`elastic_rounds.report_silent`; an
        elastic MPI job's `fault_tolerance.silent_key`): under `key(n)`, for the n that
        `number(the last n told, or None)` gives (an elastic job: its current round, one report
        each; an MPI job's: 1, 2, ...), until the attempt is over."""
        over, store = self.attempt_over, self.store

        def watch() -> None:
            block_agent_signals()
            told = None
            while not over.is_set():
                now = number(told)
                if now == told or not store.wait_for([key(now)], SILENT_POLL_S):
                    over.wait(SILENT_POLL_S if now == told else 0)
                    continue
                text = store.get(key(now))
                if text is not None:
                    self.events.put(SilentRanks(now, json.loads(text)))
                told = now

        with signals_blocked():
            threading.Thread(target=watch, name="tandem-silent", daemon=True).start()

    def start_on(self, node: Node, workers: list[int], slots: list[int], placement: Placement,
                 number: int | None = None) -> None:
        """Start `workers` (a fixed attempt's ranks, or an elastic round's new workers: round
        `number`) on `node`'s local `slots` as ranks `placement.offset`, ...: here, or by the
        word `workers` to its agent (`member.Member.start`)."""
        node.workers.update(zip(workers, slots, strict=True))
        if node.peer is None:
            self.ranks.start(placement, workers, slots, number)
            return
        shared = {key: value for key, value in dataclasses.asdict(placement).items()
                  if key not in ("store_key", "gloo_interface")}  # the agent's own
        self.nodes.send(node, ("workers", {"workers": workers, "slots": slots, "round": number,
                                           "placement": shared}))
