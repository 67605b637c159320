"""What a failure does, by job: the policies of the one watch (`supervisor.Supervisor`).

The watch reads the events and moves the job's state; its policy, chosen by the job, says what
a rank's exit, a signal, another agent's word or loss mean. `Fixed` is the plain case of every
hook (the first failure stops every rank); `Shrinking` (an elastic MPI job), `Elastic` (an
elastic job's node 0, in rounds: a fixed job is its case min = max, where no round without a
rank is ever big enough) and `Member` (another node's agent) change some of them.
"""

from __future__ import annotations

import signal

from tandem.job.preemption import EXIT_PREEMPTED
from tandem.launch import events
from tandem.launch.local.failure import Failure
from tandem.launch.local.processes import KILL_WAIT_S, STOP_GRACE_S, describe
from tandem.rendezvous.elastic_rounds import arrived

DRAIN_S = 2.0  # how long to wait for the last output of ranks that have exited
REMOTE_STOP_S = STOP_GRACE_S + KILL_WAIT_S + 5.0  # how long other nodes may take to stop


def below(what: str, left: int | str, low: int) -> str:
    """The line of an elastic job that stops: too few ranks left (`left`), or finishing."""
    why = f"{left} rank(s) left, below --min-np {low}" if isinstance(left, int) else left
    return f"tandem run: {what}; {why}: stopping the job"


class Fixed:
    """A fixed job, and the plain case of every hook: the first failure anywhere stops every
    rank, on every node (`nodes`: node 0's table of them and of the ranks live in them; None on
    a plain local job)."""

    def __init__(self, watch, nodes=None) -> None:
        self.watch, self.nodes = watch, nodes
        # after SIGKILL here, how long to wait: the other nodes stop too
        watch.kill_wait = REMOTE_STOP_S if nodes is not None else KILL_WAIT_S

    def rank_failed(self, rank: int, returncode: int) -> None:
        """A rank here exited non-zero: the first failure stops the others. On a plain local
        job a rank that exits EXIT_PREEMPTED saved at the step every rank agreed on: the
        others are saving too."""
        w = self.watch
        if returncode == EXIT_PREEMPTED and w.node is None:
            w.preempted.add(rank)
        elif w.failure is None:
            if w.node is not None:
                w.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                 "stopping every rank of the job")
            elif w.ranks.live:
                w.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                 f"stopping the other {len(w.ranks.live)} rank(s)")
            w.stop(w.rank_failure(rank, returncode))

    def rank_finished(self, rank: int) -> None:
        """A rank here exited 0."""

    def interrupted(self, signum: int) -> None:
        """SIGINT/SIGTERM/... to the agent: passed on to the ranks."""
        w = self.watch
        startup = bool(w.ranks.live) and w.ranks.starting() == w.ranks.live
        if not startup:  # during start-up, one line once they are stopped (the agent's)
            w.output.message(f"tandem run: received {signal.Signals(signum).name}; stopping "
                             "all ranks (send it again to kill them at once)")
        w.stop(Failure(node=w.node, host=w.host, interrupt=signum, startup=startup), signum)

    def handle(self, event: events.Event) -> None:
        """Any other event: another node's word or loss; an agent that joins is refused."""
        match event:
            case events.Message(number, kind, body):
                self._message(number, kind, body)
            case events.Lost(number, why):
                self._lost(number, why)
            case events.Joined(conn=conn):
                try:
                    conn.send(("refused", {"reason": "the job is running with all its nodes"}))
                except OSError:
                    pass
                conn.close()

    def tell_stop(self) -> None:
        """The watch stops its ranks: tell the other nodes."""
        if self.nodes is not None:
            self.nodes.tell_all(("stop", {}))

    def others_running(self) -> bool:
        """Whether something besides this machine's ranks must end first: ranks of other
        nodes that did not say they exited."""
        return self.nodes is not None and bool(self.nodes.remote_live())

    def give_up(self) -> None:
        w = self.watch
        if self.nodes is None:
            self.give_up_here()
            return
        nodes = {self.nodes.node_of(worker).number for worker in self.nodes.remote_live()}
        w.output.message(f"tandem run: giving up on ranks {sorted(w.ranks.live)} and nodes "
                         f"{sorted(nodes)} that did not stop")

    def give_up_here(self) -> None:
        w = self.watch
        ranks = ", ".join(f"rank {rank} (pid {w.ranks.pids[rank]})" for rank in sorted(w.ranks.live))
        w.output.message(f"tandem run: {ranks} did not exit {w.kill_wait:.0f} s after "
                         "SIGKILL (stuck in the kernel?); giving up on them")

    def shrunk(self, np: int) -> str | None:
        """The last line of a job that ended without some of its ranks."""
        return None

    def silence(self, key: int, who: str, report: dict) -> None:
        """Worker `key` (`who` in words) did not answer the watchdog of rank `report['by']`,
        whose wait for it timed out: say so, and remember why it is killed."""
        w = self.watch
        w.silenced[key] = (f"stopped answering (rank {report['by']}'s wait for it timed out "
                           f"after {report['waited']:g} s and it did not answer the watchdog: "
                           "stopped, hung or deadlocked); killed")
        w.output.message(f"tandem run: elastic: rank {who} did not answer rank {report['by']}'s "
                         f"watchdog after a {report['waited']:g} s wait: killing it (SIGKILL)")

    def remote_exit(self, number: int, body: dict) -> Failure | None:
        """Node `number` says one of its ranks (workers) exited: its slot is free; the
        `Failure` (with the rank's last lines) when it failed, None when it exited 0."""
        worker, returncode = int(body["worker"]), int(body["returncode"])
        node = self.nodes.gone(worker)
        if not returncode:
            return None
        return Failure(node=number, host=node.host if node is not None else "?", rank=worker,
                       pid=body.get("pid"), returncode=returncode,
                       tail=tuple(body.get("tail") or ()))

    def _message(self, number: int, kind: str, body: dict) -> None:
        """Another node's word: a rank there exited (a failure stops the job), a signal there."""
        w = self.watch
        if kind == "exit":
            failure = self.remote_exit(number, body)
            if failure is not None and w.failure is None:
                w.output.message(f"tandem run: rank {failure.rank} on node {number} failed: "
                                 f"{describe(failure.returncode)}; stopping every rank of the job")
                w.stop(failure)
        elif kind == "interrupted" and w.failure is None:
            node = self.nodes.nodes.get(number)
            w.stop(Failure(node=number, host=node.host if node else "?",
                           interrupt=body["signum"]))

    def _lost(self, number: int, why: str) -> None:
        """Another agent went away or silent: the job stops, and cannot be restarted as it was
        (its ranks, lost with it, are no longer waited for)."""
        w = self.watch
        first, count = self.nodes.placement().get(number, (0, 1))
        node, _ = self.nodes.lost(number)
        lost = Failure(node=number, host=node.host if node else "?", lost=why,
                       ranks=(first, first + count - 1))
        w.output.message(f"tandem run: {lost.headline()}; stopping the job")
        if w.failure is None:
            w.stop(lost)
        elif w.failure.restartable:
            w.failure = lost  # a job without that node cannot be restarted


class Shrinking(Fixed):
    """An elastic MPI job (a plain local job's watch whose world shrinks in place): a failed
    rank is dropped while `low` ranks are running or finished; below, the job stops."""

    def __init__(self, watch, low: int) -> None:
        super().__init__(watch)
        self.low = low
        self.dropped: dict[int, int] = {}  # ranks dropped -> their exit codes

    def rank_failed(self, rank: int, returncode: int) -> None:
        w = self.watch
        if returncode == EXIT_PREEMPTED or w.failure is not None:
            super().rank_failed(rank, returncode)
            return
        running = len(w.ranks.live)
        left = running + len(w.finished)
        how = w.silenced.get(rank, describe(returncode))
        if left < self.low:
            w.output.message(below(f"rank {rank} {how}", left, self.low))
            w.stop(w.rank_failure(rank, returncode))
            return
        self.dropped[rank] = returncode
        pid = w.ranks.pids[rank]
        w.output.message(
            f"tandem run: elastic: world {running + 1} -> {running}: rank {rank} (pid {pid}) "
            f"{how}; the other ranks shrink the MPI world and go on (--min-np {self.low})"
            if running else
            f"tandem run: elastic: rank {rank} (pid {pid}) {how} after the others finished")

    def rank_finished(self, rank: int) -> None:
        self.watch.finished.add(rank)  # counted toward --min-np

    def handle(self, event: events.Event) -> None:
        """A rank's wait timed out and these workers (first ranks) did not answer its watchdog
        (`td.elastic.run` reports them on the store): kill them; the others shrink without."""
        w = self.watch
        if not isinstance(event, events.SilentRanks):
            super().handle(event)
        elif not w.stopping:
            report = event.report
            for rank in sorted(set(report["workers"]) & w.ranks.live - set(w.silenced)):
                self.silence(rank, f"{rank} (pid {w.ranks.pids[rank]})", report)
                w.ranks.signal(signal.SIGKILL, {rank})

    def shrunk(self, np: int) -> str | None:
        if not self.dropped:
            return None
        pids = self.watch.ranks.pids
        lost = "; ".join(f"rank {rank} (pid {pids[rank]}) {describe(code)}"
                         for rank, code in sorted(self.dropped.items()))
        return (f"tandem run: elastic: the job ended on {len(self.watch.finished)} of {np} "
                f"ranks (--min-np {self.low}), without {lost}")


class Elastic(Fixed):
    """An elastic job's node 0, in rounds (`rounds`, the job's `elastic.Rounds`): a failed
    worker, here or on another node, shrinks the job while `--min-np` are left; slots and
    nodes grow it; the job ends once its workers finished and only late ones are left."""

    def __init__(self, watch, rounds) -> None:
        super().__init__(watch)
        self.rounds, self.nodes = rounds, rounds.nodes
        self.dismissed: set[int] = set()  # late workers stopped at the job's end (`late`)
        if self.nodes.several:
            watch.kill_wait = REMOTE_STOP_S

    def rank_failed(self, rank: int, returncode: int) -> None:
        self.nodes.gone(rank)
        self._worker_failed(rank, returncode, self.watch.rank_failure(rank, returncode))

    def rank_finished(self, rank: int) -> None:
        self.nodes.gone(rank)
        self.watch.finished.add(rank)
        self._end_without_late()

    def handle(self, event: events.Event) -> None:
        w = self.watch
        match event:
            case events.Message() | events.Lost():
                super().handle(event)  # this job's `_message`, `_lost`
            case events.Joined():
                node = self.nodes.admit(event)
                if node is not None and not (w.stopping or self.finishing()):
                    self._grow(node, f"node {node.number} ({node.host}) joined")
            case events.Rejected(where, why):
                w.output.message(f"tandem run: rejected an agent from {where}: {why}")
            case _ if w.stopping or self.finishing():
                self._end_without_late()  # a newcomer got ready after the others finished
            case events.SilentRanks(number, report):
                self._silent(number, report)
            case events.WorkersReady(workers):
                self.rounds.admit(workers, f"{len(workers)} worker(s) joined")
            case events.SlotsOffered(slots) if not self.rounds.pending:
                self._discovered(slots)

    def give_up(self) -> None:
        self.give_up_here()

    def finishing(self) -> bool:
        """A worker exited 0: the job is at its end."""
        return bool(self.watch.finished)

    def late(self) -> set[int]:
        """Once the job is finishing: the live workers that will never train with the finished
        ones. Those still starting (no round will include them now), and the newcomers of a
        round that a finished worker never entered (they wait for it in the roll call)."""
        rounds = self.rounds
        live = self.nodes.live()
        late = live & rounds.pending
        newest = rounds.round
        if newest is not None and any(w in newest.workers and not arrived(
                rounds.store, newest.number, w) for w in self.watch.finished):
            late |= {w for w in newest.workers if w in live
                     and rounds.first_round.get(w) == newest.number}
        return late

    def _end_without_late(self) -> None:
        """The job is over when only late workers are left: stop them, end with code 0."""
        if self.watch.stopping or not self.finishing():
            return
        live = self.nodes.live()
        late = self.late()
        if not live or live - late:
            return
        self.dismissed |= late
        names = ", ".join(map(str, sorted(late)))
        self.watch.output.message(f"tandem run: elastic: the job's ranks finished before "
                                  f"worker(s) {names} could join them; stopping {names}")
        self.watch.stop(None)

    def _worker_failed(self, worker: int, returncode: int, failure: Failure) -> None:
        """Worker `worker` (here or on another node) exited `returncode` != 0: the round
        without it, while `--min-np` are left; else the job stops."""
        rounds, w = self.rounds, self.watch
        if w.failure is not None or worker in self.dismissed:
            return
        if worker in rounds.pending:  # never joined a round: the others did not miss it
            rounds.pending.discard(worker)
            w.output.message(f"tandem run: elastic: new worker {worker} "
                             f"{describe(returncode)} before it joined; the job goes on")
            return
        rank = rounds.round.rank_of(worker)
        how = w.silenced.get(worker, describe(returncode))
        where = f" on node {failure.node}" if failure.node else ""
        if not self.finishing() and rounds.shrink(
                {worker: how}, f"rank {rank} (worker {worker}{where}) {how}"):
            return
        self._end(f"worker {worker} {describe(returncode)}", failure)

    def _end(self, what: str, failure: Failure) -> None:
        """Stop the whole elastic job: too few workers left, or the job was finishing."""
        left = "the job was finishing" if self.finishing() else len(self.nodes.live())
        self.watch.output.message(below(what, left, self.rounds.low))
        self.watch.stop(failure)

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
            if worker not in live or worker in self.watch.silenced or node is None:
                continue
            where = f" on node {node.number}" if node.number else ""
            self.silence(worker, f"{rank} (worker {worker}{where})", report)
            if node.peer is None:
                self.watch.ranks.signal(signal.SIGKILL, {worker})
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
            self.watch.output.message(f"tandem run: elastic: {why}; starting {count} worker(s)")
            self.rounds.grow(node, count)

    def _message(self, number: int, kind: str, body: dict) -> None:
        """Another node's word: one of its workers exited."""
        if kind != "exit":
            return
        failure = self.remote_exit(number, body)
        if failure is None:
            self.watch.finished.add(int(body["worker"]))
            self._end_without_late()
        else:
            self._worker_failed(failure.rank, failure.returncode, failure)

    def _lost(self, number: int, reason: str) -> None:
        """Node `number`'s agent went away or silent: its workers are lost with it."""
        rounds = self.rounds
        node, workers = self.nodes.lost(number)
        if rounds.agents is not None:
            rounds.agents.forget(number)
        if node is None or self.watch.stopping or self.finishing():
            return
        rounds.pending.difference_update(workers)
        how = f"was lost with node {number} ({node.host})"
        why = f"node {number} ({node.host}) is unreachable: {reason}"
        in_round = {w: how for w in workers if rounds.round.rank_of(w) is not None}
        if not in_round:
            self.watch.output.message(f"tandem run: elastic: {why}; none of its workers had "
                                      "joined")
            return
        if rounds.shrink(in_round, why):
            return
        ranks = sorted(rounds.round.rank_of(w) for w in in_round)
        self._end(f"node {number} ({node.host}) is unreachable", Failure(
            node=number, host=node.host, lost=reason, ranks=(ranks[0], ranks[-1])))


class Member(Fixed):
    """Another node's agent (`member`, its `agents.member.Member`): node 0 decides. `ended`:
    node 0's last word, ("finish", body), ("lost", why), ("signal", signum)..."""

    def __init__(self, watch, member) -> None:
        super().__init__(watch)
        self.member, self.elastic = member, member.config.elastic
        self.ended: tuple[str, object] | None = None

    def rank_failed(self, rank: int, returncode: int) -> None:
        w = self.watch
        if not self.elastic:  # a fixed job stops at its first failure: here at once
            w.stop(w.rank_failure(rank, returncode))
        self._report(rank, returncode)
        self._settled()

    def rank_finished(self, rank: int) -> None:
        self._report(rank, 0)
        self._settled()

    def _report(self, rank: int, returncode: int) -> None:
        """Node 0 hears of every exit, once the rank's output is drained (its last lines come
        before the job's summary): the next round, or the end of a fixed job's attempt."""
        w = self.watch
        w.output.join(DRAIN_S, [rank])
        self.member.peer.send(("exit", {"worker": rank, "returncode": returncode,
                                        "pid": w.ranks.pids.get(rank),
                                        "tail": list(w.output.tail(rank))}))

    def interrupted(self, signum: int) -> None:
        """Node 0 hears of it: an elastic job goes on without this machine; a fixed job's node 0
        stops the attempt and ends the job, whose code this agent waits for."""
        w = self.watch
        self.member.peer.send(("interrupted", {"signum": signum}))
        if self.elastic:
            self.ended = ("signal", signum)
            super().interrupted(signum)
            return
        if w.ranks.live:
            w.stop(Failure(node=w.node, host=w.host, interrupt=signum), signum)
        if not w.ranks.live:
            self.ended = ("signal", signum)

    def handle(self, event: events.Event) -> None:
        match event:
            case events.Message(_, kind, body):
                self._from_node0(kind, body)
            case events.Lost(_, why):
                self.member.say(f"node 0 ({self.member.master}) is unreachable: {why}; "
                                f"stopping this node's {'workers' if self.elastic else 'ranks'}")
                self.ended = ("lost", why)
                self._stop_here()
            case _:
                super().handle(event)

    def others_running(self) -> bool:
        return self.ended is None

    def give_up(self) -> None:
        what = "workers" if self.elastic else "ranks"
        self.member.say(f"{what} {sorted(self.watch.ranks.live)} did not exit after SIGKILL")

    def _settled(self) -> None:
        """Once this node's ranks are all down, a stop (node 0's, or a failure here) is over:
        wait for node 0's word (the next attempt or round, or the finish) without a deadline."""
        w = self.watch
        if not w.ranks.live and self.ended is None and w.stopping:
            w.advance(events.JobState.RUNNING)

    def _stop_here(self) -> None:
        if self.watch.ranks.live and not self.watch.stopping:
            self.watch.stop(None)

    def _from_node0(self, kind: str, body: dict) -> None:
        """What node 0 says: start an attempt or a round's workers, stop, kill, finish."""
        member = self.member
        if kind == "workers" and self.ended is None and not self.watch.stopping:
            member.start(body)  # a fixed job's attempt, or an elastic round's workers
        elif kind == "stop":
            self._stop_here()
        elif kind == "kill":  # a stuck worker (`Elastic._silent` on node 0)
            self.watch.ranks.signal(signal.SIGKILL, set(body["workers"]))
        elif kind == "finish":
            self.ended = ("finish", body)
            self._stop_here()
        elif kind == "refused":
            member.say(f"node 0 refused this agent: {body['reason']}")
            self.ended = ("refused", body)
        elif kind == "note":
            self.watch.output.message(body["text"])

    def verdict(self) -> int:
        """This node's exit code: node 0's for the job, 128 + N after signal N, 2 when
        refused, 1 when node 0 was lost."""
        kind, body = self.ended or ("lost", None)
        if kind == "finish":
            if body.get("summary"):
                self.watch.output.message(body["summary"])
            return int(body["code"])
        if kind == "signal":
            return 128 + int(body)
        return 2 if kind == "refused" else 1
