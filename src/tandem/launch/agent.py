"""The local agent: host the rendezvous store, start the ranks, watch them, stop them together.

Every rank runs in its own session (`start_new_session=True`), so it and any children it
starts form one process group that the agent can signal as a whole. One waiter thread per rank
reports its exit on an event queue; the agent's signal handlers report on the same queue, and
the main thread reacts to whichever comes first. Stopping is SIGTERM (or the signal the agent
got), `STOP_GRACE_S` to exit, then SIGKILL: the whole job is down within seconds of a failure.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from tandem import rendezvous
from tandem.environments import tandem_variables
from tandem.launch.config import LaunchConfig
from tandem.launch.output import AGENT_SIGNALS, RankOutput, block_agent_signals

STOP_GRACE_S = 2.0  # between the polite signal and SIGKILL; the contract stops a job in 5 s
KILL_WAIT_S = 5.0  # after SIGKILL, how long a rank may take to disappear
DRAIN_S = 2.0  # how long to wait for the last output of ranks that have exited
MASTER_ADDR = "127.0.0.1"


def exit_code(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """`exit code 3`, or `killed by SIGKILL (exit code 137)`."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} (exit code {exit_code(returncode)})"


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, so taskset/cgroups count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def rank_command(config: LaunchConfig) -> list[str]:
    """The command line of every rank: this Python, running the script or module."""
    if config.module:
        return [sys.executable, "-u", "-m", config.program, *config.args]
    return [sys.executable, "-u", config.program, *config.args]


def rank_environment(
    config: LaunchConfig, rank: int, port: int, base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of one local rank: ours, plus tandem's variables and thread limits."""
    env = job_environment(config, base)
    env.update(
        tandem_variables(
            rank=rank, size=config.np, local_rank=rank, local_size=config.np,
            master_addr=MASTER_ADDR, master_port=port, store_hosted=True,
            backend=config.backend,
        )
    )
    return env


def job_environment(config: LaunchConfig, base: Mapping[str, str]) -> dict[str, str]:
    """What every rank gets whoever starts it (us, or mpiexec): timeout, threads, unbuffered."""
    env = dict(base)
    if config.timeout is not None:
        env["TANDEM_TIMEOUT"] = str(config.timeout)
    if config.timeline is not None:
        env["TANDEM_TIMELINE"] = os.path.abspath(config.timeline)
    # N ranks each running one thread per core would oversubscribe the machine N times.
    threads = config.threads_per_rank or max(1, cores() // config.np)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if config.threads_per_rank is not None or name not in base:
            env[name] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def _signals_blocked():
    """Threads created inside (the store's server thread) leave our signals to this thread."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # a rank's pid is its process group id (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


@dataclass(frozen=True)
class RankExit:
    rank: int
    pid: int
    returncode: int


class LocalAgent:
    """Runs one job of `config.np` ranks on this machine; `run()` returns the job's exit code."""

    def __init__(
        self, config: LaunchConfig, stdout: TextIO | None = None, stderr: TextIO | None = None
    ) -> None:
        self.config = config
        self.output = RankOutput(stdout, stderr)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # put() is signal-handler safe
        self._procs: dict[int, subprocess.Popen] = {}

    def run(self) -> int:
        previous = self._install_signal_handlers()
        try:
            with _signals_blocked():
                store = rendezvous.host_store(MASTER_ADDR, 0)  # lives until the ranks are gone
            try:
                self._start_ranks(store.port)
                failure, interrupt = self._supervise()
            finally:
                # Ranks are reaped by now (or unstoppable); this takes their children down too.
                for proc in self._procs.values():
                    _signal_group(proc.pid, signal.SIGKILL)
            self.output.join(DRAIN_S)  # the last lines, before we exit and they are lost
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if failure is not None:
            self._summarize(failure)
            return exit_code(failure.returncode)
        return 128 + interrupt if interrupt is not None else 0

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}  # signal handlers can only be set from the main thread
        return {
            signum: signal.signal(signum, self._on_signal)
            for signum in AGENT_SIGNALS
            # `nohup tandem run` ignores SIGHUP (a background job, SIGINT): so do the ranks.
            if signal.getsignal(signum) is not signal.SIG_IGN
        }

    def _on_signal(self, signum: int, frame: object) -> None:
        self._events.put(("signal", signum))

    def _start_ranks(self, port: int) -> None:
        command = rank_command(self.config)
        for rank in range(self.config.np):
            proc = subprocess.Popen(
                command,
                env=rank_environment(self.config, rank, port, os.environ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self._procs[rank] = proc
            self.output.attach(rank, proc.stdout, proc.stderr)
            threading.Thread(
                target=self._wait, args=(rank, proc), name=f"tandem-rank{rank}-wait",
                daemon=True,
            ).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        block_agent_signals()
        self._events.put(("exit", rank, proc.wait()))

    def _signal_live(self, live: set[int], signum: int) -> None:
        for rank in sorted(live):
            _signal_group(self._procs[rank].pid, signum)

    def _supervise(self) -> tuple[RankExit | None, int | None]:
        """React to rank exits and signals until every rank is gone.

        Returns the first rank to fail, and the signal that interrupted the job (either may be
        None; never both, as whichever comes first starts the stop).
        """
        live = set(self._procs)
        failure: RankExit | None = None
        interrupt: int | None = None
        deadline: float | None = None  # when stopping: the moment to escalate
        killed = False
        while live:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                if killed:
                    self._report_unstoppable(live)
                    break
                self._signal_live(live, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + KILL_WAIT_S
                continue
            if event[0] == "exit":
                _, rank, returncode = event
                live.discard(rank)
                if returncode != 0 and failure is None and interrupt is None:
                    failure = RankExit(rank, self._procs[rank].pid, returncode)
                    if live:
                        self.output.message(
                            f"tandem run: rank {rank} failed: {describe(returncode)}; "
                            f"stopping the other {len(live)} rank(s)"
                        )
                    self._signal_live(live, signal.SIGTERM)
                    deadline = time.monotonic() + STOP_GRACE_S
            elif interrupt is None and failure is None:
                interrupt = event[1]
                self.output.message(
                    f"tandem run: received {signal.Signals(interrupt).name}; stopping all ranks "
                    "(send it again to kill them at once)"
                )
                self._signal_live(live, interrupt)  # Ctrl-C reaches the ranks as Ctrl-C
                deadline = time.monotonic() + STOP_GRACE_S
            elif not killed:  # a second signal, or one during a stop: no more grace
                self._signal_live(live, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + KILL_WAIT_S

        return failure, interrupt

    def _summarize(self, failure: RankExit) -> None:
        lines = [
            f"tandem run: job failed: rank {failure.rank} (pid {failure.pid}) "
            f"{describe(failure.returncode)}; it was the first rank to fail."
        ]
        tail = self.output.tail(failure.rank)
        if tail:
            lines.append(f"tandem run: last {len(tail)} line(s) of rank {failure.rank}:")
            lines.extend(f"  [{failure.rank}] {line}" for line in tail)
        else:
            lines.append(f"tandem run: rank {failure.rank} printed nothing.")
        self.output.message("\n".join(lines))

    def _report_unstoppable(self, live: set[int]) -> None:
        ranks = ", ".join(f"rank {rank} (pid {self._procs[rank].pid})" for rank in sorted(live))
        self.output.message(
            f"tandem run: {ranks} did not exit {KILL_WAIT_S:.0f} s after SIGKILL "
            "(stuck in the kernel?); giving up on them"
        )
