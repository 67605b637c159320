"""What went wrong in a job, in words: the first failure of an attempt and its summary.

`Failure` is the first thing that went wrong (a rank that failed, a lost node, a signal), the
same for every kind of job and on every node; `summary` is what every agent prints when a job
(or one attempt of it) fails, with the failed rank's last lines and, where they say a port was
taken, the fix (`port_taken`); `silent_ranks` reads who the ranks' watchdog named as stuck.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from tandem.launch.local.output import RankOutput
from tandem.launch.local.processes import describe, exit_code


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


def silent_ranks(output: RankOutput, np: int) -> tuple[int, ...]:
    """The ranks of the job's `np` that some rank's watchdog named as not answering at all (a
    stopped, hung or deadlocked process; the ranks that timed out waiting for it fail first,
    and the summary should not blame them alone). Noted as the lines passed: the report, a stack
    per rank, can be longer than the last lines kept."""
    return tuple(sorted(rank for rank in output.named_silent() if rank < np))


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
