"""The rank supervisor: one watch over a job's ranks, fed by typed events; it says why it ended.

One loop (`Supervisor.run`) watches every job: a plain single-node job and each attempt of a
restartable or multi-node one, an elastic job's rounds and an elastic MPI job, all run by the
one agent (`agents.coordinator.Coordinator` on node 0, whose ranks `ranks.LocalRanks` or, under
`--backend mpi`, `mpiexec.MPIExecRanks` start), and every other node's agent. Rank exits,
signals to the agent and messages from other agents all arrive as typed events on one queue,
which the main thread reads with a deadline; the loop moves the job's state (`JobState`) and
stops the ranks (SIGTERM to each rank's process group, SIGKILL after `STOP_GRACE_S`, giving up
`KILL_WAIT_S` later on what still does not exit: the whole job is down within seconds), and the
job's policy (`policies`: fixed, elastic, shrinking MPI, another node) says what each event
means. SIGINT/SIGTERM/SIGHUP to the agent are passed on to the ranks; a second one kills them.

When every rank is gone the attempt is over; `failure.Failure` and `failure.summary` put its
first failure into words. `Agent` is what the agents share: the event queue, the prefixed
output, the ranks, the signal handlers.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from contextlib import contextmanager
from typing import TextIO

from tandem.job import preemption
from tandem.launch.config import LaunchConfig
from tandem.launch.events import Event, JobState, RankExited, Signalled
from tandem.launch.local.failure import Failure, port_taken, silent_ranks, summary
from tandem.launch.local.joined import JoinWatch, script_of
from tandem.launch.local.output import AGENT_SIGNALS, RankOutput
from tandem.launch.local.policies import DRAIN_S, Elastic, Fixed, Member, Shrinking
from tandem.launch.local.processes import STOP_GRACE_S
from tandem.launch.local.ranks import LocalRanks


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
    the job's policy (`policies`), not by a subclass: `Fixed` (a plain local job, `node` None;
    node 0's attempt of one with restarts or several nodes, `nodes`), `Elastic` (an elastic
    job's node 0, `rounds`), `Shrinking` (an elastic MPI job, `low`: its --min-np), `Member`
    (another node's agent, `member`).
    """

    def __init__(self, ranks: LocalRanks, events: queue.SimpleQueue, output: RankOutput,
                 node: int | None = None, host: str | None = None, *, nodes=None,
                 rounds=None, member=None,
                 low: int | None = None) -> None:
        self.ranks, self.events, self.output = ranks, events, output
        self.node, self.host = node, host
        self.failure: Failure | None = None
        self.state = JobState.RUNNING
        self.deadline: float | None = None  # STOPPING, KILLING: the moment to escalate
        self.preempted: set[int] = set()  # ranks that saved and exited EXIT_PREEMPTED
        self.finished: set[int] = set()  # ranks (elastic: workers) that exited 0
        self.silenced: dict[int, str] = {}  # stuck workers killed -> why
        self.kill_wait = 0.0  # after SIGKILL, how long to wait (the policy's)
        self.policy = (Member(self, member) if member is not None else
                       Elastic(self, rounds) if rounds is not None else
                       Shrinking(self, low) if low is not None else
                       Fixed(self, nodes))

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
        while self.ranks.live or self.policy.others_running():
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if self.ranks.live and not self.killed:
                    self.kill()
                    continue
                self.policy.give_up()
                break
            self.handle(event)
        self.advance(JobState.SUCCEEDED if self.failure is None else JobState.FAILED)
        return self.failure

    def handle(self, event: Event) -> None:
        """One event: a rank's exit, a signal to the agent; the rest is the policy's."""
        match event:
            case RankExited(rank, returncode):
                self.ranks.exited(rank)
                if returncode != 0:
                    self.policy.rank_failed(rank, returncode)
                else:
                    self.policy.rank_finished(rank)
            case Signalled(signum):
                if not self.stopping:
                    self.policy.interrupted(signum)
                elif not self.killed:  # a second signal, or one during a stop: no more grace
                    self.kill()
            case _:
                self.policy.handle(event)

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
            self.policy.tell_stop()
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

    def shrunk(self, np: int) -> str | None:
        """The last line of an elastic MPI job that ended without some of its ranks."""
        return self.policy.shrunk(np)

    def verdict(self) -> int:
        """Another node's exit code (`policies.Member.verdict`)."""
        return self.policy.verdict()


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


__all__ = ["DRAIN_S", "Agent", "Failure", "StartInterrupted", "Supervisor", "port_taken",
           "signals_to", "silent_ranks", "summary"]
