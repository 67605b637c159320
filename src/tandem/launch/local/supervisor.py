"""The rank supervisor: watch this machine's ranks, stop them all on the first failure, say why.

One loop (`Supervisor.run`) serves every kind of job: a plain single-node job (`LocalJob`,
whose ranks `ranks.LocalRanks` or, under `--backend mpi`, `mpiexec.MPIExecRanks` start), each
attempt of a restartable or multi-node job on node 0 (`coordinator.Coordinator`) and on the
other nodes (`member.Member`). Rank exits, signals to the agent and, on multi-node jobs,
messages from other agents all arrive as events on one queue, which the main thread reads
with a deadline:

- a rank exits non-zero: the first failure stops every other rank (SIGTERM to each rank's
  process group, SIGKILL after `STOP_GRACE_S`, giving up `KILL_WAIT_S` later on what still
  does not exit: the whole job is down within seconds);
- SIGINT/SIGTERM/SIGHUP to the agent: passed on to the ranks; a second one kills them at once.

When every rank is gone the attempt is over; `Failure` and `summary` put its first failure
into words, the same way for every kind of job and on every node. `Agent` is what those three
kinds of job share: the event queue, the prefixed output, the ranks, the signal handlers.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from tandem import rendezvous
from tandem.job import preemption
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.launch.config import LaunchConfig
from tandem.launch.events import Event, JobState, RankExited, Signalled
from tandem.launch.local.joined import JoinWatch, script_of
from tandem.launch.local.output import AGENT_SIGNALS, RankOutput, signals_blocked
from tandem.launch.local.processes import KILL_WAIT_S, STOP_GRACE_S, describe, exit_code
from tandem.launch.local.ranks import MASTER_ADDR, LocalRanks, Placement

DRAIN_S = 2.0  # how long to wait for the last output of ranks that have exited


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
    """One attempt's watch over this machine's ranks; `run()` returns its first failure.

    The hooks (`rank_exited`, `rank_finished`, `interrupted`, `other`, `others_running`,
    `give_up`) are where node 0 and the other nodes of a multi-node job add their conversation
    with each other.
    """

    kill_wait = KILL_WAIT_S  # after SIGKILL, how long to wait before giving up

    def __init__(self, ranks: LocalRanks, events: queue.SimpleQueue, output: RankOutput,
                 node: int | None = None, host: str | None = None) -> None:
        self.ranks, self.events, self.output = ranks, events, output
        self.node, self.host = node, host
        self.failure: Failure | None = None
        self.state = JobState.RUNNING
        self.deadline: float | None = None  # STOPPING, KILLING: the moment to escalate
        self.preempted: set[int] = set()  # ranks that saved and exited EXIT_PREEMPTED

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
        """One event: a rank's exit, a signal to the agent, or the kind of job's (`other`)."""
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
            case _:
                self.other(event)

    def stop(self, failure: Failure | None, signum: int = signal.SIGTERM) -> None:
        """Record the first failure; stop every rank here (`signum`, SIGKILL after a grace).

        SIGINT reaches only ranks past their start: one still importing would just print a
        KeyboardInterrupt traceback from inside the import, with nothing of its own to save;
        SIGTERM ends it without a word.
        """
        if self.failure is None:
            self.failure = failure
        if not self.stopping:
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

    # -- hooks ---------------------------------------------------------------------------
    def rank_exited(self, rank: int, returncode: int) -> None:
        """A rank exited non-zero; the first one stops the others. A rank that exits
        EXIT_PREEMPTED saved at the step every rank agreed on: the others are saving too."""
        if returncode == EXIT_PREEMPTED:
            self.preempted.add(rank)
            return
        if self.failure is None:
            if self.ranks.live:
                self.output.message(f"tandem run: rank {rank} failed: {describe(returncode)}; "
                                    f"stopping the other {len(self.ranks.live)} rank(s)")
            self.stop(self.rank_failure(rank, returncode))

    def rank_finished(self, rank: int) -> None:
        """A rank exited 0 (an elastic job's agents tell node 0; nothing to do otherwise)."""

    def interrupted(self, signum: int) -> None:
        startup = bool(self.ranks.live) and self.ranks.starting() == self.ranks.live
        if not startup:  # during start-up, one line once they are stopped (`LocalJob`)
            self.output.message(f"tandem run: received {signal.Signals(signum).name}; stopping "
                                "all ranks (send it again to kill them at once)")
        self.stop(Failure(node=self.node, host=self.host, interrupt=signum, startup=startup),
                  signum)

    def other(self, event: Event) -> None:
        """An event that is not a rank's exit nor a signal (a message from another agent)."""

    def others_running(self) -> bool:
        """Whether something besides this machine's ranks must end first (other nodes)."""
        return False

    def give_up(self) -> None:
        ranks = ", ".join(f"rank {rank} (pid {self.ranks.pids[rank]})"
                          for rank in sorted(self.ranks.live))
        self.output.message(f"tandem run: {ranks} did not exit {self.kill_wait:.0f} s after "
                            "SIGKILL (stuck in the kernel?); giving up on them")


class Agent:
    """This machine's side of a job: its event queue, its output and its ranks.

    `run()` turns signals into events, runs `_run()` (the kind of job: `LocalJob`, node 0's
    `Coordinator`, another node's `Member`), and kills whatever is left of the ranks after it.
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


class LocalJob(Agent):
    """A job of `config.np` ranks on this machine, without restarts; `run()` returns its code.

    The exit code is 0, the first failing rank's, or 128 + N after signal N (no summary then:
    a person stopped the job; one line when that was during start-up). `ranks` starts them:
    `LocalRanks`, or `MPIExecRanks`.
    """

    def _run(self) -> int:
        with signals_blocked():  # the store's threads leave our signals to this one
            store = rendezvous.StoreServer(MASTER_ADDR, 0)  # lives until the ranks are gone
        placement = Placement.single(self.config.np, store.port, store.key)
        watch = JoinWatch(store)
        preempted: set[int] = set()
        try:
            try:
                self.ranks.start(placement)
            except StartInterrupted as interrupt:  # ranks not all started: nothing to wait for
                failure = Failure(interrupt=interrupt.signum, startup=True)
            else:
                supervisor = Supervisor(self.ranks, self.events, self.output)
                failure = supervisor.run()
                preempted = supervisor.preempted
        finally:
            self.ranks.reap()
            store.close()
        self.output.join(DRAIN_S)  # the last lines, before we exit and they are lost
        if preempted and (failure is None or failure.interrupt is not None):
            self.output.message(f"tandem run: preempted: rank(s) {sorted(preempted)} saved at "
                                f"the step they agreed on; exit {EXIT_PREEMPTED} (resume me: "
                                f"the next run restores the checkpoint)")
            return EXIT_PREEMPTED
        if failure is not None and failure.startup:
            self.output.message(f"tandem run: interrupted during start-up "
                                f"({signal.Signals(failure.interrupt).name}); stopped "
                                f"{self.config.np} rank(s)")
        if failure is None:
            return self.independent_copies(watch)
        if failure.interrupt is not None:
            return failure.code
        failure = dataclasses.replace(failure, tail=tuple(self.output.tail(failure.rank)),
                                      silent=silent_ranks(self.output, self.config.np))
        self.output.message(summary(failure))
        return failure.code
