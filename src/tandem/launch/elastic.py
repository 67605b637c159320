"""`tandem run --min-np A --max-np B`: a job that goes on when ranks fail and grows when it can.

The agent hosts the store and starts `-np` ranks, each a *worker* with an id of its own for
the life of its process. Who forms the world is a *round* on the store
(`rendezvous.elastic_rounds`): the workers in rank order. The rank supervisor's loop
(`supervisor.Supervisor`) watches them, with two differences:

- a rank that fails does not stop the others: the agent publishes the next round without it,
  and the survivors (`tandem.elastic.run`) leave the broken world at the failure, join the new
  round, take the last committed state from one of them and go on. Below `--min-np` survivors
  the job ends like any failed job, with the summary naming the first rank that failed;
- `--host-discovery-script` is run every `DISCOVERY_S` seconds; when it offers more slots
  than there are ranks (up to `--max-np`), the agent starts new workers in a new round, and the
  ranks move to it at their next `State.commit()`.

Every transition is one line: the old and new world and why. A rank that exits 0 means the
job is finishing: no round changes after that, and a failure then ends the job.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import TextIO

from tandem import rendezvous
from tandem.launch.config import LaunchConfig, StartError
from tandem.launch.output import block_agent_signals, signals_blocked
from tandem.launch.processes import describe, start_failure_code, start_ranks
from tandem.launch.ranks import MASTER_ADDR, LocalRanks, Placement, rank_command, rank_environment
from tandem.launch.supervisor import DRAIN_S, Agent, Failure, Supervisor, summary
from tandem.rendezvous.elastic_rounds import Round, publish, ready_key, report_death
from tandem.settings import DEFAULT_TIMEOUT_S

DISCOVERY_S = 1.0  # how often --host-discovery-script runs
DISCOVERY_TIMEOUT_S = 10.0  # a discovery script that takes longer is killed and reported


class ElasticRanks(LocalRanks):
    """The workers of an elastic job: started in groups, whenever a round adds some; the
    output and the events name each by its worker id (its rank when the job started)."""

    def start_workers(self, workers: list[int], first_rank: int, size: int, number: int,
                      store: rendezvous.StoreServer) -> None:
        """Start `workers` as ranks `first_rank`, ... of a world of `size`, for round `number`
        (-1: a round that will add them, once they are ready). `td.init()` reads its place
        from the store's current round anyway; these are where it starts from."""
        self.store_port = store.port
        placement = Placement(attempt=0, offset=first_rank, world=size,
                              store=(MASTER_ADDR, store.port), store_key=store.key)
        low, high = self.config.min_np or 1, self.config.max_np or self.config.np
        envs = []
        for local, worker in enumerate(workers):
            env = rank_environment(self.config, local, placement, os.environ, size)
            env.update(TANDEM_ELASTIC_ROUND=str(number), TANDEM_ELASTIC_WORKER=str(worker),
                       TANDEM_ELASTIC_RANGE=f"{low}:{high}")
            envs.append(env)
        command = rank_command(self.config)
        try:
            processes = start_ranks(command, envs)
        except OSError as error:
            raise StartError(f"could not start {command[0]}: {error.strerror or error}",
                             code=start_failure_code(error)) from None
        for worker, proc in zip(workers, processes, strict=True):
            self.watch(worker, proc.pid, proc.stdout, proc.stderr, proc.wait)


class ElasticJob(Agent):
    """One machine's elastic job; `run()` returns its exit code."""

    def __init__(self, config: LaunchConfig, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:
        super().__init__(config, ranks=ElasticRanks, stdout=stdout, stderr=stderr)
        self.low, self.high = config.min_np or 1, config.max_np or config.np
        self.store: rendezvous.StoreServer | None = None
        self.round: Round | None = None
        self.next_worker = 0
        self.pending: set[int] = set()  # started, not yet in a round (`grow`, `admit`)
        self._stop_discovery = threading.Event()

    def _run(self) -> int:
        with signals_blocked():  # the store's threads leave our signals to this one
            self.store = rendezvous.StoreServer(MASTER_ADDR, 0)
        try:
            self.start(self.config.np)
            if self.config.discovery is not None:
                with signals_blocked():
                    threading.Thread(target=self._discover, name="tandem-discovery",
                                     daemon=True).start()
            failure = _ElasticWatch(self).run()
        finally:
            self._stop_discovery.set()
            self.ranks.reap()
            self.store.close()
        self.output.join(DRAIN_S)
        if failure is None:
            return 0
        if failure.interrupt is not None:
            return failure.code
        tail = tuple(self.output.tail(failure.rank)) if failure.rank is not None else ()
        failure = Failure(rank=failure.rank, pid=failure.pid, returncode=failure.returncode,
                          tail=tail)
        self.output.message(summary(failure))
        return failure.code

    # -- rounds ----------------------------------------------------------------------------
    def publish(self, workers: list[int], why: str, since: float) -> Round:
        number = 0 if self.round is None else self.round.number + 1
        old = 0 if self.round is None else self.round.size
        self.round = Round(number, tuple(workers), why, since)
        publish(self.store, self.round)
        if number:
            self.output.message(f"tandem run: elastic: world {old} -> {len(workers)} "
                                f"(round {number}): {why}")
        return self.round

    def start(self, count: int) -> None:
        """The job's first workers: round 0."""
        workers = list(range(count))
        self.next_worker = count
        self.publish(workers, "start", time.time())
        self.ranks.start_workers(workers, 0, count, 0, self.store)

    def grow(self, count: int) -> None:
        """Start `count` new workers; their round is formed once they are ready (`admit`)."""
        new = list(range(self.next_worker, self.next_worker + count))
        self.next_worker += count
        self.pending.update(new)
        first = len(self.ranks.live)
        self.ranks.start_workers(new, first, first + count, -1, self.store)
        keys = [ready_key(worker) for worker in new]
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S

        def wait_ready() -> None:
            block_agent_signals()
            if self.store.wait_for(keys, timeout):
                self.events.put(("ready", tuple(new)))

        threading.Thread(target=wait_ready, name="tandem-elastic-ready", daemon=True).start()

    def admit(self, workers: tuple[int, ...], why: str) -> None:
        """The new workers reached td.init(): the round that adds those still alive."""
        joining = [w for w in workers if w in self.pending and w in self.ranks.live]
        self.pending.difference_update(workers)
        if joining:
            staying = [w for w in self.round.workers if w in self.ranks.live]
            self.publish(staying + joining, why, time.time())

    def shrink(self, worker: int, returncode: int) -> Round | None:
        """The round without `worker`; None when too few would be left."""
        rank = self.round.rank_of(worker)
        report_death(self.store, self.round.number, rank, describe(returncode))
        staying = [w for w in self.round.workers if w in self.ranks.live]
        if len(staying) < self.low:
            return None
        return self.publish(staying, f"rank {rank} (worker {worker}) {describe(returncode)}",
                            time.time())

    # -- discovery -------------------------------------------------------------------------
    def _discover(self) -> None:
        said = None
        while not self._stop_discovery.wait(DISCOVERY_S):
            slots, problem = discover(self.config.discovery)
            if problem is not None and problem != said:
                self.output.message(f"tandem run: --host-discovery-script: {problem}")
            said = problem
            if slots is not None:
                self.events.put(("slots", slots))


def discover(script: str) -> tuple[int | None, str | None]:
    """The slots the discovery script offers on this machine: (slots, None), or (None, why)."""
    try:
        done = subprocess.run([script], capture_output=True, text=True,
                              timeout=DISCOVERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"could not run it: {error}"
    if done.returncode != 0:
        return None, f"it exited {done.returncode}: {done.stderr.strip()[-200:]}"
    slots = 0
    for line in done.stdout.split():
        host, _, count = line.partition(":")
        try:
            slots += int(count) if count else 1
        except ValueError:
            return None, f"{line!r} is not `host:slots`"
    return slots, None


class _ElasticWatch(Supervisor):
    """The supervisor's loop, where a failed rank shrinks the job instead of ending it."""

    def __init__(self, job: ElasticJob) -> None:
        super().__init__(job.ranks, job.events, job.output)
        self.job = job
        self.failed: set[int] = set()

    def finishing(self) -> bool:
        """A worker exited 0: the job is at its end."""
        return bool(set(self.ranks.pids) - self.ranks.live - self.failed)

    def rank_exited(self, worker: int, returncode: int) -> None:
        self.failed.add(worker)
        if self.failure is not None:
            return
        if worker in self.job.pending:  # never joined a round: the others did not miss it
            self.job.pending.discard(worker)
            self.output.message(f"tandem run: elastic: new worker {worker} "
                                f"{describe(returncode)} before it joined; the job goes on")
            return
        if not self.finishing() and self.job.shrink(worker, returncode) is not None:
            return
        left = len(self.ranks.live)
        why = (f"{left} rank(s) left, below --min-np {self.job.low}" if not self.finishing()
               else "the job was finishing")
        self.output.message(f"tandem run: worker {worker} {describe(returncode)}; {why}: "
                            f"stopping the job")
        self.stop(self.rank_failure(worker, returncode))

    def other(self, event: tuple) -> None:
        if self.stopping or self.finishing():
            return
        if event[0] == "ready":
            self.job.admit(event[1], f"{len(event[1])} worker(s) joined")
        elif event[0] == "slots" and not self.job.pending:
            missing = min(self.job.high, event[1]) - len(self.ranks.live)
            if missing > 0:
                self.output.message(f"tandem run: elastic: the discovery script offers "
                                    f"{event[1]} slot(s); starting {missing} worker(s)")
                self.job.grow(missing)


def launch(config: LaunchConfig) -> int:
    return ElasticJob(config).run()
