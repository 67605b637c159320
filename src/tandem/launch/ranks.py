"""This machine's share of a job, one attempt at a time: start the ranks, signal them, report exits.

Used by the agents of restartable and multi-node jobs (`restart.Coordinator`,
`multinode.Member`); plain single-node jobs keep `agent.LocalAgent`. The ranks are started
exactly as `LocalAgent` starts them (same command, same environment, each in its own session so
that its process group can be signalled as a whole), plus their place in the whole job: global
rank, world size, the rendezvous store, `TANDEM_RESTART=<attempt>`, and on multi-node jobs the
network interface Gloo should use. Exits arrive as ("exit", rank, returncode) events on the
agent's queue; `Failure` and `summary` put a failure into words the same way on every node.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.environments import tandem_variables
from tandem.launch.agent import describe, exit_code, rank_command, rank_environment
from tandem.launch.config import LaunchConfig
from tandem.launch.output import RankOutput, block_agent_signals


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks sit in one attempt of the job (node 0 decides, tells everyone)."""

    attempt: int
    offset: int  # global rank of this node's first rank
    world: int
    store: tuple[str, int]
    gloo_interface: str | None = None


@dataclass(frozen=True)
class Failure:
    """The first thing that went wrong in an attempt: a rank that failed, or a lost node."""

    node: int
    host: str
    rank: int | None = None
    pid: int | None = None
    returncode: int | None = None
    tail: tuple[str, ...] = ()
    lost: str | None = None  # why the node is unreachable
    interrupt: int | None = None  # the signal that stopped the job, when a person did

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
            return f"node {self.node} ({self.host}) is unreachable: {self.lost}"
        return (f"rank {self.rank} (pid {self.pid}, node {self.node} on {self.host}) "
                f"{describe(self.returncode)}; it was the first rank to fail")


def summary(failure: Failure, attempts: str = "") -> str:
    """What every agent prints when a job (or one attempt of it) fails."""
    lines = [f"tandem run: job failed{attempts}: {failure.headline()}."]
    if failure.rank is not None and failure.lost is None and failure.interrupt is None:
        if failure.tail:
            lines.append(f"tandem run: last {len(failure.tail)} line(s) of rank {failure.rank}:")
            lines.extend(f"  [{failure.rank}] {line}" for line in failure.tail)
        else:
            lines.append(f"tandem run: rank {failure.rank} printed nothing.")
    return "\n".join(lines)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # a rank's pid is its process group id (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


class LocalRanks:
    """The ranks this machine runs in one attempt; exits become ("exit", rank, code) events."""

    def __init__(self, config: LaunchConfig, nproc: int, events: queue.SimpleQueue,
                 output: RankOutput) -> None:
        self.config, self.nproc, self._events, self.output = config, nproc, events, output
        self.procs: dict[int, subprocess.Popen] = {}
        self.live: set[int] = set()

    def environment(self, local: int, placement: Placement,
                    base: Mapping[str, str]) -> dict[str, str]:
        host, port = placement.store
        env = rank_environment(self.config, local, port, base)
        env.update(tandem_variables(
            rank=placement.offset + local, size=placement.world, local_rank=local,
            local_size=self.nproc, master_addr=host, master_port=port, store_hosted=True,
            backend=self.config.backend,
        ))
        env["TANDEM_RESTART"] = str(placement.attempt)
        env.pop("TANDEM_SECRET", None)  # the agents' secret is none of the ranks' business
        if placement.gloo_interface and "GLOO_SOCKET_IFNAME" not in base:
            env["GLOO_SOCKET_IFNAME"] = placement.gloo_interface
        return env

    def start(self, placement: Placement) -> None:
        self.procs, self.live = {}, set()
        command = rank_command(self.config)
        for local in range(self.nproc):
            rank = placement.offset + local
            proc = subprocess.Popen(
                command, env=self.environment(local, placement, os.environ),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self.procs[rank] = proc
            self.live.add(rank)
            self.output.attach(rank, proc.stdout, proc.stderr)
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True,
                             name=f"tandem-rank{rank}-wait").start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        block_agent_signals()
        self._events.put(("exit", rank, proc.wait()))

    def exited(self, rank: int) -> None:
        self.live.discard(rank)

    def signal(self, signum: int) -> None:
        for rank in sorted(self.live):
            _signal_group(self.procs[rank].pid, signum)

    def reap(self) -> None:
        """Kill what is left of every rank's process group (children the ranks started)."""
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGKILL)

    def failure(self, rank: int, returncode: int, node: int, host: str) -> Failure:
        return Failure(node=node, host=host, rank=rank, pid=self.procs[rank].pid,
                       returncode=returncode, tail=tuple(self.output.tail(rank)))
