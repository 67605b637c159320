"""What an agent's main thread reads from its one queue: typed events, and the job's state.

Every thread that learns something (a rank's waiter, a signal handler, a peer's reader, the
control plane's listener, discovery, an ssh agent's waiter, mpiexec's launch port) puts one of
these on the agent's queue; the main thread reads them with a deadline and decides. Each is a
small frozen dataclass, matched by type (`match event: case RankExited(rank, code): ...`),
never by a tuple's first word.

`JobState` is where one agent's watch over its ranks stands (`supervisor.Supervisor.state`):
RUNNING until the first failure or signal, STOPPING (the ranks were signalled, a grace runs),
KILLING (SIGKILL sent, a last wait), then SUCCEEDED or FAILED. `Supervisor.advance` is the one
place that moves it, and only forwards (`JobState.next_allowed`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class JobState(enum.Enum):
    """Where one attempt's watch over this machine's ranks stands."""

    RUNNING = "running"  # ranks started; the first failure or signal stops them
    STOPPING = "stopping"  # SIGTERM (or the signal passed on) sent; a grace before SIGKILL
    KILLING = "killing"  # SIGKILL sent; a last wait before giving up on what is left
    SUCCEEDED = "succeeded"  # every rank is down and nothing failed
    FAILED = "failed"  # every rank is down (or given up on) after a failure or a signal

    @property
    def done(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)

    def next_allowed(self) -> frozenset[JobState]:
        """The states this one may move to: forwards only (a member's stop that node 0 asked
        for goes back to RUNNING once its workers are down, to wait for node 0's word)."""
        return _NEXT[self]


_NEXT = {
    JobState.RUNNING: frozenset({JobState.STOPPING, JobState.KILLING, JobState.SUCCEEDED,
                                 JobState.FAILED}),
    JobState.STOPPING: frozenset({JobState.KILLING, JobState.RUNNING, JobState.SUCCEEDED,
                                  JobState.FAILED}),
    JobState.KILLING: frozenset({JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
}


class Event:
    """The base of everything on an agent's queue."""


@dataclass(frozen=True)
class RankExited(Event):
    """A rank (an elastic job's worker: its worker id) of this machine exited."""

    rank: int
    returncode: int


@dataclass(frozen=True)
class Signalled(Event):
    """SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 reached the agent."""

    signum: int


@dataclass(frozen=True)
class Message(Event):
    """Another agent said something on the control plane: `(kind, body)` as it was sent."""

    node: int
    kind: str
    body: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Lost(Event):
    """Another agent went away or silent (`control.Peer`); `why` in words."""

    node: int
    why: str


@dataclass(frozen=True)
class Joined(Event):
    """An agent authenticated on node 0's control plane and said hello."""

    conn: Any
    hello: Any
    where: str


@dataclass(frozen=True)
class Rejected(Event):
    """An agent failed to authenticate (at the store or the control plane)."""

    where: str
    why: str


@dataclass(frozen=True)
class AgentExited(Event):
    """-H: the ssh command of the agent of node `node` on `host` exited with `code`."""

    node: int
    host: str
    code: int


@dataclass(frozen=True)
class WorkersReady(Event):
    """Elastic: new workers reached td.init(); a round may add them."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class SilentRanks(Event):
    """Elastic: a rank's wait in round `round` timed out; `report` names who never answered."""

    round: int
    report: dict


@dataclass(frozen=True)
class SlotsOffered(Event):
    """Elastic: the discovery script's latest `{host: slots}`."""

    slots: dict


@dataclass(frozen=True)
class LaunchConnected(Event):
    """MPI: a rank's supervisor connected to the launch port (`kind`: stdout, stderr,
    control)."""

    rank: int
    kind: str
    connection: Any


def message(node: int, sent: Any) -> Message:
    """The `Message` for what node `node` sent: `(kind, body)`, or `(kind,)`."""
    if isinstance(sent, tuple) and sent and isinstance(sent[0], str):
        body = sent[1] if len(sent) > 1 and isinstance(sent[1], dict) else {}
        return Message(node, sent[0], body)
    return Message(node, "?", {})


__all__ = ["AgentExited", "Event", "JobState", "Joined", "LaunchConnected", "Lost", "Message",
           "Rejected", "RankExited", "SilentRanks", "Signalled", "SlotsOffered", "WorkersReady",
           "message"]
