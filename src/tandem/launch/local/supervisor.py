"""The rank supervisor: watch a job's ranks, stop them all on the first failure, say why.

One loop (`Supervisor.run`) watches every fixed job: a plain single-node job and each attempt
of a restartable or multi-node one, all run by the one agent (`agents.coordinator.Coordinator`
on node 0, whose ranks `ranks.LocalRanks` or, under `--backend mpi`, `mpiexec.MPIExecRanks`
start); an elastic job's rounds and the other nodes' agents change its hooks. Rank exits,
signals to the agent and messages from other agents all arrive as typed events on one queue,
which the main thread reads with a deadline:

- a rank exits non-zero: the first failure stops every other rank (SIGTERM to each rank's
  process group, SIGKILL after `STOP_GRACE_S`, giving up `KILL_WAIT_S` later on what still
  does not exit: the whole job is down within seconds), on every node;
- SIGINT/SIGTERM/SIGHUP to the agent: passed on to the ranks; a second one kills them at once.

When every rank is gone the attempt is over; `Failure` and `summary` put its first failure
into words, the same way for every kind of job and on every node. `Agent` is what the agents
share: the event queue, the prefixed output, the ranks, the signal handlers.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from tandem.job import preemption
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.launch.config import LaunchConfig
from tandem.launch.events import (
    Event,
    JobState,
    Joined,
    Lost,
    Message,
    RankExited,
    Rejected,
    Signalled,
    SilentRanks,
    SlotsOffered,
    WorkersReady,
)
from tandem.launch.local.joined import JoinWatch, script_of
from tandem.launch.local.output import AGENT_SIGNALS, RankOutput
from tandem.launch.local.processes import KILL_WAIT_S, STOP_GRACE_S, describe, exit_code
from tandem.launch.local.ranks import LocalRanks
from tandem.rendezvous.elastic_rounds import arrived

DRAIN_S = 2.0  # how long to wait for the last output of ranks that have exited
REMOTE_STOP_S = STOP_GRACE_S + KILL_WAIT_S + 5.0  # how long other nodes may take to stop


@dataclass(frozen=True)
class Failure:
    """The first thing that went wrong in an attempt: a rank that failed, a lost node, a signal.

    `node` and `host` are None on a single-node job without restarts, whose summary does not
    name them.
    """

    node: int | None = None
    host: str | None = None
    rank: int | None = None
    pid: int | None = None
    returncode: int | None = None
    tail: tuple[str, ...] = ()
    lost: str | None = None  # why the node is unreachable
    ranks: tuple[int, int] | None = None  # the lost node's first and last rank
    interrupt: int | None = None  # the signal that stopped the job, when a person did
    startup: bool = False  # ... while every rank was still starting (see `Supervisor.stop`)
    silent: tuple[int, ...] = ()  # ranks the others' watchdog named: they stopped answering

    @property
    def code(self) -> int:
        if self.interrupt is not None:
            return 128 + self.interrupt
        return exit_code(self.returncode) if self.returncode is not None else 1

    @property
    def restartable(self) -> bool:
        """A failed rank is worth a restart; a lost node or Ctrl-C is not."""
        return self.lost is None and self.interrupt is None

    def headline(self) -> str:
        if self.interrupt is not None:
            return (f"interrupted by {signal.Signals(self.interrupt).name} on node {self.node} "
                    f"({self.host})")
        if self.lost is not None:
            where = self.host
            if self.ranks is not None:
                first, last = self.ranks
                where += f", rank {first}" if first == last else f", ranks {first}-{last}"
            return f"node {self.node} ({where}) is unreachable: {self.lost}"
        where = f", node {self.node} on {self.host}" if self.node is not None else ""
        first = (f"rank {self.rank} (pid {self.pid}{where}) {describe(self.returncode)}; "
                 "it was the first rank to fail")
        if self.silent and self.rank not in self.silent:
            stuck = ", ".join(map(str, self.silent))
            return (f"rank(s) {stuck} stopped answering (stopped, hung or deadlocked: the other "
                    f"ranks' watchdog timed out waiting for them and named them); {first}, "
                    f"waiting for them")
        return first


def summary(failure: Failure, attempts: str = "") -> str:
    """What every agent prints when a job (or one attempt of it) fails."""
    lines = [f"tandem run: job failed{attempts}: {failure.headline()}."]
    if failure.rank is not None and failure.restartable:
        if failure.tail:
            lines.append(f"tandem run: last {len(failure.tail)} line(s) of rank {failure.rank}:")
            lines.extend(f"  [{failure.rank}] {line}" for line in failure.tail)
            taken = port_taken(failure.rank, failure.tail)
            if taken is not None:
                lines.append(taken)
        else:
            lines.append(f"tandem run: rank {failure.rank} printed nothing.")
    return "\n".join(lines)


_SILENT = re.compile(r"\brank (\d+): did not answer the watchdog\b")


def silent_ranks(output: RankOutput, np: int) -> tuple[int, ...]:
    """The ranks that some rank's watchdog named as not answering at all, from the ranks' last
    lines (a stopped, hung or deadlocked process; the ranks that timed out waiting for it fail
    first, and the summary should not blame them alone)."""
    named = {int(found) for rank in range(np) for line in output.tail(rank)
             for found in _SILENT.findall(line)}
    return tuple(sorted(named))


_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_PORT = re.compile(r"\bport\W{0,3}(\d{1,5})\b", re.IGNORECASE)


def port_taken(rank: int, tail: tuple[str, ...]) -> str | None:
    """The fix, when the failed rank's last lines say that a port it wanted is taken: most
    often a MASTER_PORT hard-coded in the script, which every job on the machine then asks
    for (tandem run gives each job a free one of its own)."""
    lines = [line for line in tail if _IN_USE.search(line)]
    if not lines:
        return None
    found = _PORT.search(lines[-1])
    port = f"port {found.group(1)}" if found else "a port it asked for"
    return (f"tandem run: rank {rank} could not listen on {port}: the address is already in "
            "use (another job or program holds it). If the script sets MASTER_PORT itself, "
            "remove that line: tandem run gives every job a free port of its own (MASTER_PORT "
            "is set for every rank); or set MASTER_PORT to a port that nothing else uses.")


def _grace(failure: Failure | None) -> float:
    """How long the ranks get between the signal and SIGKILL: a preemption signal passed on
    (TANDEM_PREEMPT_SIGNALS) lets them finish their step and save, the lead a scheduler gives
    (TANDEM_PREEMPT_LEAD); anything else, a moment."""
    if failure is not None and failure.interrupt in preemption.signal_numbers(
            os.environ.get("TANDEM_PREEMPT_SIGNALS")):
        return float(os.environ.get("TANDEM_PREEMPT_LEAD") or preemption.DEFAULT_LEAD_S)
    return STOP_GRACE_S


@contextmanager
def signals_to(events: queue.SimpleQueue):
    """While inside, SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 to the agent become `Signalled`
    events.

    `nohup tandem run` ignores SIGHUP (a background job, SIGINT): so do the ranks. Handlers can
    only be set from the main thread; elsewhere (a test calling `launch`) nothing changes.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, lambda s, f: events.put(Signalled(s)))
                    for signum in AGENT_SIGNALS
                    if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class Supervisor:
    """The one watch over a job's ranks, whatever the job; `run()` returns its first failure.

    One loop and one state (`JobState`), fed by typed events; what a failure does is decided by
    the job, not by a subclass:

    - a fixed job (a plain local one, `node` None; node 0's attempt of one with restarts or
      several nodes, `nodes`): the first failure anywhere stops every rank on every node, and
      the attempt lasts until every node says its ranks are down. On a plain local job a rank
      that saved and exited EXIT_PREEMPTED is a preemption;
    - an elastic job's node 0 (`rounds`, the job's `elastic.Rounds`): a failed worker shrinks
      the job to a new round while `--min-np` are left (a fixed job is the case min = max: it
      never can), new slots and nodes grow it, a worker that stopped answering is killed, and
      the end is an event like the others (`late`);
    - an elastic MPI job (`low`, its --min-np: one machine, mpiexec's ranks, a world that
      shrinks in place): a failed rank is dropped while `low` ranks are running or finished;
      below, the usual stop. A rank reported silent (`SilentRanks`) is killed first;
    - another node's agent (`member`): every exit goes to node 0, which decides; a fixed job
      also stops this node's ranks at once; node 0's stop, finish or loss ends them.
    """

    def __init__(self, ranks: LocalRanks, events: queue.SimpleQueue, output: RankOutput,
                 node: int | None = None, host: str | None = None, *, nodes=None,
                 attempt: int | None = 0, offsets: dict[int, int] | None = None,
                 lost: set[int] | None = None, rounds=None, member=None,
                 low: int | None = None) -> None:
        self.ranks, self.events, self.output = ranks, events, output
        self.node, self.host = node, host
        self.failure: Failure | None = None
        self.state = JobState.RUNNING
        self.deadline: float | None = None  # STOPPING, KILLING: the moment to escalate
        self.preempted: set[int] = set()  # ranks that saved and exited EXIT_PREEMPTED
        self.rounds, self.member, self.low = rounds, member, low
        self.nodes = rounds.nodes if rounds is not None else nodes  # node 0's table of nodes
        # a fixed job's attempt (None on another node between attempts); the other nodes
        # whose ranks still run, the failed ranks' last lines, the nodes lost (the agent's)
        self.attempt, self.offsets = attempt, offsets or {}
        self.running = set(nodes.peers()) if nodes is not None and rounds is None else set()
        self.tails: dict[int, tuple[str, ...]] = {}
        self.lost = lost if lost is not None else set()
        self.finished: set[int] = set()  # elastic: workers that exited 0
        self.dismissed: set[int] = set()  # ... late workers stopped at the job's end (`late`)
        self.silenced: dict[int, str] = {}  # ... stuck workers killed (`_silent`) -> why
        self.dropped: dict[int, int] = {}  # elastic MPI: ranks dropped -> their exit codes
        self.failed: dict[int, int] = {}  # another node: this attempt's failed ranks here
        self.ended: tuple[str, object] | None = None  # ... ("finish", body), ("lost", why)...
        self.elastic = member.config.elastic if member is not None else rounds is not None
        # after SIGKILL here, how long to wait: the other nodes stop too
        self.kill_wait = REMOTE_STOP_S if self.nodes is not None and (
            rounds is None or self.nodes.several) else KILL_WAIT_S

    @property
    def stopping(self) -> bool:
        return self.state in (JobState.STOPPING, JobState.KILLING)

    @property
    def killed(self) -> bool:
        return self.state is JobState.KILLING

    def advance(self, state: JobState, deadline: float | None = None) -> None:
        """The one place the state moves (forwards, see `JobState.next_allowed`), with the
        deadline of the new state (None: wait for events without one)."""
        if state is not self.state and state not in self.state.next_allowed():
            raise AssertionError(f"the job cannot go from {self.state.name} to {state.name}")
        self.state, self.deadline = state, deadline

    def run(self) -> Failure | None:
        while self.ranks.live or self.others_running():
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if self.ranks.live and not self.killed:
                    self.kill()
                    continue
                self.give_up()
                break
            self.handle(event)
        self.advance(JobState.SUCCEEDED if self.failure is None else JobState.FAILED)
        return self.failure

    def handle(self, event: Event) -> None:
        """One event: a rank's exit, a signal to the agent, another agent's word or loss."""
        match event:
            case RankExited(rank, returncode):
                self.ranks.exited(rank)
                if returncode != 0:
                    self.rank_exited(rank, returncode)
                else:
                    self.rank_finished(rank)
            case Signalled(signum):
                if not self.stopping:
                    self.interrupted(signum)
                elif not self.killed:  # a second signal, or one during a stop: no more grace
                    self.kill()
            case Message(_, kind, body) if self.member is not None:
                self._from_node0(kind, body)
            case Message(number, kind, body) if self.rounds is not None:
                self._worker_message(number, kind, body)
            case Message(number, kind, body):
                self._message(number, kind, body)
            case Lost(number, why):
                self._lost(number, why)
            case Joined():
                self._joined(event)
            case Rejected(where, why) if self.rounds is not None:
                self.output.message(f"tandem run: rejected an agent from {where}: {why}")
            case _ if self.rounds is not None and (self.stopping or self.finishing()):
                self._end_without_late()  # a newcomer got ready after the others finished
            case SilentRanks(number, report) if self.rounds is not None:
                self._silent(number, report)
            case SilentRanks(_, report) if self.low is not None and not self.stopping:
                self._silent_here(report)
            case WorkersReady(workers) if self.rounds is not None:
                self.rounds.admit(workers, f"{len(workers)} worker(s) joined")
            case SlotsOffered(slots) if self.rounds is not None and not self.rounds.pending:
                self._discovered(slots)

    def stop(self, failure: Failure | None, signum: int = signal.SIGTERM) -> None:
        """Record the first failure; stop every rank here (`signum`, SIGKILL after a grace)
        and on the other nodes still running.

        SIGINT reaches only ranks past their start: one still importing would just print a
        KeyboardInterrupt traceback from inside the import, with nothing of its own to save;
        SIGTERM ends it without a word.
        """
        if self.failure is None:
            self.failure = failure
        if not self.stopping:
            if self.rounds is not None:
                self.nodes.tell_all(("stop", {}))
            peers = self.nodes.peers() if self.nodes is not None else {}
            for number in self.running & set(peers):
                peers[number].send(("stop", {"attempt": self.attempt}))
            starting = self.ranks.starting() if signum == signal.SIGINT else set()
            self.ranks.signal(signal.SIGTERM, starting)
            self.ranks.signal(signum, self.ranks.live - starting)
            self.advance(JobState.STOPPING, time.monotonic() + _grace(failure))

    def kill(self) -> None:
        self.ranks.signal(signal.SIGKILL)
        self.advance(JobState.KILLING, time.monotonic() + self.kill_wait)

    def rank_failure(self, rank: int, returncode: int) -> Failure:
        return Failure(node=self.node, host=self.host, rank=rank, pid=self.ranks.pids[rank],
                       returncode=returncode)

    def others_running(self) -> bool:
        """Whether something besides this machine's ranks must end first: the other nodes of
        a fixed attempt, an elastic job's remote workers, node 0's word on another node."""
        if self.member is not None:
            return self.ended is None
        if self.rounds is not None:
            return bool(self.nodes.remote_live())
        return bool(self.running)

    def give_up(self) -> None:
        if self.member is not None:
            what = "workers" if self.elastic else "ranks"
            self.member.say(f"{what} {sorted(self.ranks.live)} did not exit after SIGKILL")
        elif self.nodes is not None and self.rounds is None:
            self.output.message(f"tandem run: giving up on ranks {sorted(self.ranks.live)} and "
                                f"nodes {sorted(self.running)} that did not stop")
        else:
            ranks = ", ".join(f"rank {rank} (pid {self.ranks.pids[rank]})"
                              for rank in sorted(self.ranks.live))
            self.output.message(f"tandem run: {ranks} did not exit {self.kill_wait:.0f} s after "
                                "SIGKILL (stuck in the kernel?); giving up on them")

    # -- a rank here exited, or the agent was signalled ---------------------------------
    def rank_exited(self, rank: int, returncode: int) -> None:
        """A rank exited non-zero: the first one stops the others (a fixed job), or the job
        shrinks (elastic). On a plain local job a rank that exits EXIT_PREEMPTED saved at the
        step every rank agreed on: the others are saving too."""
        if self.member is not None:
            self.failed[rank] = returncode
            self.member.peer.send(("exit", {"attempt": self.attempt, "rank": rank, "worker": rank,
                                            "returncode": returncode,
                                            "pid": self.ranks.pids.get(rank),
                                            "tail": list(self.output.tail(rank))}))
            if not self.elastic:  # a fixed job stops at its first failure: here at once
                self.stop(self.rank_failure(rank, returncode))
            self._settled()
        elif self.rounds is not None:
            self.nodes.gone(rank)
            self._worker_failed(rank, returncode, self.rank_failure(rank, returncode))
        elif self.low is not None and returncode != EXIT_PREEMPTED and self.failure is None:
            self._drop(rank, returncode)
        elif returncode == EXIT_PREEMPTED and self.node is None:
            self.preempted.add(rank)
        elif self.failure is None:
            if self.node is not None:
                self.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                    "stopping every rank of the job")
            elif self.ranks.live:
                self.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                    f"stopping the other {len(self.ranks.live)} rank(s)")
            self.stop(self.rank_failure(rank, returncode))

    def rank_finished(self, rank: int) -> None:
        """A rank exited 0: an elastic job is at its end (node 0 hears of it)."""
        if self.member is not None:
            if self.elastic:
                self.member.peer.send(("exit", {"worker": rank, "returncode": 0}))
            self._settled()
        elif self.rounds is not None:
            self.nodes.gone(rank)
            self.finished.add(rank)
            self._end_without_late()
        elif self.low is not None:  # an elastic MPI job counts them toward --min-np
            self.finished.add(rank)

    def interrupted(self, signum: int) -> None:
        """SIGINT/SIGTERM/... to the agent: passed on to the ranks. On another node, node 0
        hears of it: an elastic job goes on without this machine; a fixed job's node 0 stops
        the attempt and ends the job, whose code this agent waits for."""
        if self.member is not None:
            self.member.peer.send(("interrupted", {"attempt": self.attempt, "signum": signum}))
            if not self.elastic:
                if self.ranks.live:
                    self.stop(Failure(node=self.node, host=self.host, interrupt=signum), signum)
                if not self.ranks.live:
                    self.ended = ("signal", signum)
                return
            self.ended = ("signal", signum)
        startup = bool(self.ranks.live) and self.ranks.starting() == self.ranks.live
        if not startup:  # during start-up, one line once they are stopped (the agent's)
            self.output.message(f"tandem run: received {signal.Signals(signum).name}; stopping "
                                "all ranks (send it again to kill them at once)")
        self.stop(Failure(node=self.node, host=self.host, interrupt=signum, startup=startup),
                  signum)

    # -- node 0 of a fixed job: the other nodes' words -------------------------------------
    def _message(self, number: int, kind: str, body: dict) -> None:
        if body.get("attempt", self.attempt) != self.attempt:
            return  # a late word about an earlier attempt
        node = self.nodes.nodes.get(number) if self.nodes is not None else None
        host = node.host if node else "?"
        if kind == "exit" and self.failure is None and body.get("returncode"):
            self.output.message(
                f"tandem run: rank {body['rank']} on node {number} failed: "
                f"{describe(body['returncode'])}; stopping every rank of the job")
            self.stop(Failure(node=number, host=host, rank=body["rank"], pid=body.get("pid"),
                              returncode=body["returncode"]))
        elif kind == "done":
            self.running.discard(number)
            self.tails.update({int(r): tuple(t) for r, t in body.get("tails", {}).items()})
        elif kind == "interrupted" and self.failure is None:
            self.stop(Failure(node=number, host=host, interrupt=body["signum"]))

    def _lost(self, number: int, why: str) -> None:
        """Another agent went away or silent (on another node: node 0)."""
        if self.member is not None:
            what = "workers" if self.elastic else "ranks"
            self.member.say(f"node 0 ({self.member.master}) is unreachable: {why}; "
                            f"stopping this node's {what}")
            self.ended = ("lost", why)
            self.attempt = None  # node 0 is gone: nobody to tell
            self._stop_here()
            return
        if self.rounds is not None:
            self._node_lost(number, why)
            return
        self.running.discard(number)
        self.lost.add(number)
        node = self.nodes.nodes.get(number) if self.nodes is not None else None
        first = self.offsets.get(number, 0)
        lost = Failure(node=number, host=node.host if node else "?", lost=why,
                       ranks=(first, first + (node.slots if node else 1) - 1))
        self.output.message(f"tandem run: {lost.headline()}; stopping the job")
        if self.failure is None:
            self.stop(lost)
        elif self.failure.restartable:
            self.failure = lost  # a job without that node cannot be restarted

    def _joined(self, event: Joined) -> None:
        """An agent joined: an elastic job grows; a fixed one has all its nodes."""
        if self.rounds is not None:
            node = self.nodes.admit(event)
            if node is not None and not (self.stopping or self.finishing()):
                self._grow(node, f"node {node.number} ({node.host}) joined")
            return
        try:
            event.conn.send(("refused", {"reason": "the job is running with all its nodes"}))
        except OSError:
            pass
        event.conn.close()

    # -- node 0 of an elastic job: rounds ----------------------------------------------------
    def finishing(self) -> bool:
        """A worker exited 0: the job is at its end."""
        return bool(self.finished)

    def late(self) -> set[int]:
        """Once the job is finishing: the live workers that will never train with the finished
        ones. Those still starting (no round will include them now), and the newcomers of a
        round that a finished worker never entered (they wait for it in the roll call)."""
        rounds = self.rounds
        live = self.nodes.live()
        late = live & rounds.pending
        newest = rounds.round
        if newest is not None and any(w in newest.workers and not arrived(
                rounds.store, newest.number, w) for w in self.finished):
            late |= {w for w in newest.workers if w in live
                     and rounds.first_round.get(w) == newest.number}
        return late

    def _end_without_late(self) -> None:
        """The job is over when only late workers are left: stop them, end with code 0."""
        if self.stopping or not self.finishing():
            return
        live = self.nodes.live()
        late = self.late()
        if not live or live - late:
            return
        self.dismissed |= late
        names = ", ".join(map(str, sorted(late)))
        self.output.message(f"tandem run: elastic: the job's ranks finished before worker(s) "
                            f"{names} could join them; stopping {names}")
        self.stop(None)

    def _worker_failed(self, worker: int, returncode: int, failure: Failure) -> None:
        """Worker `worker` (here or on another node) exited `returncode` != 0: the round
        without it, while `--min-np` are left; else the job stops."""
        rounds = self.rounds
        if self.failure is not None or worker in self.dismissed:
            return
        if worker in rounds.pending:  # never joined a round: the others did not miss it
            rounds.pending.discard(worker)
            self.output.message(f"tandem run: elastic: new worker {worker} "
                                f"{describe(returncode)} before it joined; the job goes on")
            return
        rank = rounds.round.rank_of(worker)
        how = self.silenced.get(worker, describe(returncode))
        where = f" on node {failure.node}" if failure.node else ""
        why = f"rank {rank} (worker {worker}{where}) {how}"
        if not self.finishing() and rounds.shrink({worker: how}, why):
            return
        self._end(f"worker {worker} {describe(returncode)}", failure)

    def _end(self, what: str, failure: Failure) -> None:
        """Stop the whole elastic job: too few workers left, or the job was finishing."""
        left = len(self.nodes.live())
        why = (f"{left} rank(s) left, below --min-np {self.rounds.low}" if not self.finishing()
               else "the job was finishing")
        self.output.message(f"tandem run: {what}; {why}: stopping the job")
        self.stop(failure)

    def _silent(self, number: int, report: dict) -> None:
        """A rank's wait in round `number` timed out and these ranks never answered its
        watchdog: they are the stuck ones (SIGSTOP, a hung kernel, a deadlock). Kill them; their
        exits form the round without them, and the ranks that waited go on."""
        current = self.rounds.round
        if number != current.number:
            return
        live = self.nodes.live()
        for rank in report["ranks"]:
            if not 0 <= rank < current.size:
                continue
            worker = current.workers[rank]
            node = self.nodes.node_of(worker)
            if worker not in live or worker in self.silenced or node is None:
                continue
            self.silenced[worker] = (
                f"stopped answering (rank {report['by']}'s wait for it timed out after "
                f"{report['waited']:g} s and it did not answer the watchdog: stopped, hung or "
                f"deadlocked); killed")
            self.output.message(f"tandem run: elastic: rank {rank} (worker {worker}"
                                f"{f' on node {node.number}' if node.number else ''}) did not "
                                f"answer rank {report['by']}'s watchdog after a "
                                f"{report['waited']:g} s wait: killing it (SIGKILL)")
            if node.peer is None:
                self.ranks.signal(signal.SIGKILL, {worker})
            else:
                self.nodes.send(node, ("kill", {"workers": [worker]}))

    def _discovered(self, offered: dict[str, int]) -> None:
        """The discovery script's hosts: on one machine, all its slots are this machine's;
        with -H, a host that runs no agent gets one (`ssh.HostAgents`)."""
        here = self.nodes.nodes[0]
        agents = self.rounds.agents
        if agents is None:
            here.slots = sum(offered.values())
            self._grow(here, f"the discovery script offers {here.slots} slot(s)")
            return
        if agents.hosts[0] in offered:
            here.slots = offered[agents.hosts[0]]
            self._grow(here, f"the discovery script offers {here.slots} slot(s) here")
        agents.discovered({name: min(slots, self.rounds.high) for name, slots in offered.items()})

    def _grow(self, node, why: str) -> None:
        count = min(self.rounds.high - len(self.nodes.live()), node.capacity())
        if count > 0:
            self.output.message(f"tandem run: elastic: {why}; starting {count} worker(s)")
            self.rounds.grow(node, count)

    def _worker_message(self, number: int, kind: str, body: dict) -> None:
        if kind != "exit":
            return
        worker, returncode = int(body["worker"]), int(body["returncode"])
        node = self.nodes.gone(worker)
        if returncode == 0:
            self.finished.add(worker)
            self._end_without_late()
            return
        host = node.host if node is not None else "?"
        self._worker_failed(worker, returncode, Failure(
            node=number, host=host, rank=worker, pid=body.get("pid"), returncode=returncode,
            tail=tuple(body.get("tail") or ())))

    def _node_lost(self, number: int, reason: str) -> None:
        """Node `number`'s agent went away or silent: its workers are lost with it."""
        rounds = self.rounds
        node, workers = self.nodes.lost(number)
        if rounds.agents is not None:
            rounds.agents.forget(number)
        if node is None or self.stopping or self.finishing():
            return
        rounds.pending.difference_update(workers)
        how = f"was lost with node {number} ({node.host})"
        why = f"node {number} ({node.host}) is unreachable: {reason}"
        in_round = {w: how for w in workers if rounds.round.rank_of(w) is not None}
        if not in_round:
            self.output.message(f"tandem run: elastic: {why}; none of its workers had joined")
            return
        if rounds.shrink(in_round, why):
            return
        ranks = sorted(rounds.round.rank_of(w) for w in in_round)
        self._end(f"node {number} ({node.host}) is unreachable", Failure(
            node=number, host=node.host, lost=reason, ranks=(ranks[0], ranks[-1])))

    # -- an elastic MPI job: ranks dropped in place ------------------------------------------
    def _drop(self, rank: int, returncode: int) -> None:
        """Rank `rank` failed: the others shrink the MPI world without it while `low` ranks
        are running or finished; below, the job stops."""
        running = len(self.ranks.live)
        left = running + len(self.finished)
        how = self.silenced.get(rank, describe(returncode))
        if left < self.low:
            self.output.message(f"tandem run: rank {rank} {how}; {left} rank(s) left, below "
                                f"--min-np {self.low}: stopping the job")
            self.stop(self.rank_failure(rank, returncode))
            return
        self.dropped[rank] = returncode
        self.output.message(
            f"tandem run: elastic: world {running + 1} -> {running}: rank {rank} (pid "
            f"{self.ranks.pids[rank]}) {how}; the other ranks shrink the MPI world and go "
            f"on (--min-np {self.low})" if running else
            f"tandem run: elastic: rank {rank} (pid {self.ranks.pids[rank]}) {how} after "
            f"the others finished")

    def _silent_here(self, report: dict) -> None:
        """A rank's wait timed out and these workers (first ranks) did not answer its watchdog
        (`td.elastic.run` reports them on the store): kill them; the others shrink without."""
        for rank in sorted(set(report["workers"]) & self.ranks.live - set(self.silenced)):
            self.silenced[rank] = (f"stopped answering (rank {report['by']}'s wait for it timed "
                                   f"out after {report['waited']:g} s and it did not answer the "
                                   "watchdog: stopped, hung or deadlocked); killed")
            self.output.message(f"tandem run: elastic: rank {rank} (pid {self.ranks.pids[rank]}) "
                                f"did not answer rank {report['by']}'s watchdog after a "
                                f"{report['waited']:g} s wait: killing it (SIGKILL)")
            self.ranks.signal(signal.SIGKILL, {rank})

    def shrunk(self, np: int) -> str | None:
        """The last line of an elastic MPI job that ended without some of its ranks."""
        if not self.dropped:
            return None
        lost = "; ".join(f"rank {rank} (pid {self.ranks.pids[rank]}) {describe(code)}"
                         for rank, code in sorted(self.dropped.items()))
        return (f"tandem run: elastic: the job ended on {len(self.finished)} of {np} ranks "
                f"(--min-np {self.low}), without {lost}")

    # -- another node: node 0 decides ---------------------------------------------------------
    def _settled(self) -> None:
        """Once this node's ranks are all down: a fixed job's attempt is over here (say so, with
        the failed ranks' last lines); a stop node 0 asked for is over. Wait for node 0's word
        (the next attempt or round, or the finish) without a deadline again."""
        if self.ranks.live:
            return
        if self.attempt is not None:
            self.output.join(DRAIN_S)
            tails = {rank: self.output.tail(rank) for rank in self.failed}
            self.member.peer.send(("done", {"attempt": self.attempt, "tails": tails}))
            self.attempt = None
        if self.ended is None and self.stopping:
            self.advance(JobState.RUNNING)

    def _stop_here(self) -> None:
        if self.ranks.live and not self.stopping:
            self.stop(None)

    def _from_node0(self, kind: str, body: dict) -> None:
        """What node 0 says: start an attempt or a round's workers, stop, kill, finish."""
        member = self.member
        if kind == "start" and self.ended is None:  # a fixed job's attempt
            self.attempt, self.failed, self.failure = body["attempt"], {}, None
            member.start_attempt(body)
        elif kind == "workers" and self.ended is None and not self.stopping:  # elastic
            member.start_workers(body)
        elif kind == "stop" and body.get("attempt", self.attempt) == self.attempt:
            self._stop_here()
        elif kind == "kill":  # a stuck worker (`_silent` on node 0)
            self.ranks.signal(signal.SIGKILL, set(body["workers"]))
        elif kind == "finish":
            self.ended = ("finish", body)
            self._stop_here()
        elif kind == "refused":
            member.say(f"node 0 refused this agent: {body['reason']}")
            self.ended = ("refused", body)
        elif kind == "note":
            self.output.message(body["text"])

    def verdict(self) -> int:
        """Another node's exit code: node 0's for the job, 128 + N after signal N, 2 when
        refused, 1 when node 0 was lost."""
        kind, body = self.ended or ("lost", None)
        if kind == "finish":
            if body.get("summary"):
                self.output.message(body["summary"])
            return int(body["code"])
        if kind == "signal":
            return 128 + int(body)
        return 2 if kind == "refused" else 1


class Agent:
    """This machine's side of a job: its event queue, its output and its ranks.

    `run()` turns signals into events, runs `_run()` (node 0's `Coordinator`, another node's
    `Member`), and kills whatever is left of the ranks after it.
    """

    def __init__(self, config: LaunchConfig, *, ranks: type[LocalRanks] = LocalRanks,
                 nproc: int | None = None, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:
        self.config = config
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # put() is signal-handler safe
        self.output = RankOutput(stdout, stderr)
        self.ranks = ranks(config, self.events, self.output, nproc)

    def run(self) -> int:
        with signals_to(self.events):
            try:
                return self._run()
            finally:
                # Ranks are reaped by now (or unstoppable); this takes their children down too.
                self.ranks.reap()
                self.close()

    def _run(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the job held besides its ranks (connections, mpiexec)."""
        self.ranks.close()

    def independent_copies(self, watch: JoinWatch | None) -> int:
        """The exit code of a job whose ranks all exited 0: 0, unless no rank joined it and
        --require-join says that is an error; a warning then otherwise (`launch.local.joined`)."""
        if watch is None:
            return 0
        program = " ".join((self.config.program, *self.config.args))
        line = watch.verdict(self.config.np, program, self.config.require_join,
                             script_of(self.config))
        if line is None:
            return 0
        self.output.message(line)
        return 1 if self.config.require_join else 0


class StartInterrupted(Exception):
    """A signal reached the agent while it was still starting the ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
