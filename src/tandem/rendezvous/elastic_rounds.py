"""The rounds of an elastic job, on the launcher's store: who is in the world now.

`tandem run --min-np A --max-np B` (launch/agents/elastic.py) numbers every membership of the job: a
round is the list of the worker ids that form the world, in rank order, with why it began and
when. The launcher writes a round's record first and then moves `ROUND_KEY` to it; a rank reads
`ROUND_KEY` (at each `State.commit()`, and after a peer failed) and, when it moved, joins the
new round (`tandem.elastic`). Before the engine connects, the members of a round answer a roll
call here (`arrive`): a member that died before it arrived, or a round the launcher already
replaced, ends the wait at once instead of at the engine's timeout.

Plain Python on either side: the launcher's `StoreServer` (never waits) and the ranks'
`StoreClient` (waits with a deadline) both have `set`/`get`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

ROUND_KEY = "tandem/elastic/round"
POLL_S = 0.05  # how often a roll call looks whether the round moved on (store round trips)


@dataclass(frozen=True)
class Round:
    """One membership of the job: `workers[r]` is rank r's worker id."""

    number: int
    workers: tuple[int, ...]
    why: str  # "start", "rank 2 (worker 2) failed: exit code 9", "1 worker(s) joined"
    since: float  # wall-clock seconds of the event that began it (failure, arrival)

    @property
    def size(self) -> int:
        return len(self.workers)

    def rank_of(self, worker: int) -> int | None:
        return self.workers.index(worker) if worker in self.workers else None


def record_key(number: int) -> str:
    return f"tandem/elastic/{number}/record"


def watchdog_board(number: int) -> str:
    """Where the ranks' watchdogs of round `number` meet (`comm.watchdog.monitor`: its board's prefix
    for an elastic round); `+ OVER` is set there once a later round left out one of its workers."""
    return f"tandem/watchdog/elastic/{number}/"


OVER = "over"  # on a round's watchdog board: a later round left out one of its workers


def publish(store, new: Round) -> None:
    """The launcher's side: write the round, point the job at it, and tell the watchdogs of
    every earlier round that lost a worker that their world is over (a rank still waiting in it
    stops waiting: the peer it waits for is gone). A round whose workers are all in `new` (the
    job grew) is not over: its ranks are healthy, finish what they are doing and move at their
    next commit (`State.check_host_updates`), while the new workers wait at the roll call.
    Every earlier round, not only the last: ranks may still be in an older world when a grow
    was formed and then a shrink."""
    store.set(record_key(new.number), json.dumps(
        {"workers": list(new.workers), "why": new.why, "since": new.since}))
    store.set(ROUND_KEY, str(new.number))
    staying = set(new.workers)
    for number in range(new.number):
        board = watchdog_board(number) + OVER
        if store.get(board) is None and not set(read(store, number).workers) <= staying:
            store.set(board, "1")


def current_number(store) -> int:
    return int(store.get(ROUND_KEY))


def read(store, number: int) -> Round:
    record = json.loads(store.get(record_key(number)))
    return Round(number, tuple(record["workers"]), record["why"], record["since"])


def _arrived_key(number: int, worker: int) -> str:
    return f"tandem/elastic/{number}/arrived/{worker}"


def arrived(store, number: int, worker: int) -> bool:
    """Whether `worker` answered round `number`'s roll call (the launcher asks at the job's
    end: a round that a finished worker never entered is one nobody else will enter)."""
    return store.get(_arrived_key(number, worker)) is not None


def arrive(store, joined: Round, worker: int, deadline: float) -> bool:
    """Answer round `joined`'s roll call and wait for every member: True once all are there,
    False as soon as the launcher has moved on to a later round (a member died meanwhile);
    TimeoutError at `deadline`."""
    store.set(_arrived_key(joined.number, worker), "1")
    keys = [_arrived_key(joined.number, w) for w in joined.workers]
    while True:
        if store.check(keys):
            return True
        if current_number(store) != joined.number:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [w for w, key in zip(joined.workers, keys, strict=True)
                       if not store.check([key])]
            raise TimeoutError(
                f"elastic round {joined.number}: worker(s) {missing} of {list(joined.workers)} "
                f"did not arrive")
        try:  # wakes as soon as the last one arrives; else looks at the round again
            store.wait(keys, timeout=min(POLL_S, left))
        except TimeoutError:
            pass


def report_death(store, number: int, rank: int, how: str) -> None:
    """The launcher saw rank `rank` of round `number` die: say so where the ranks' watchdogs
    look for ranks that left (`comm.watchdog.monitor`), so that a survivor's failed wait is explained at once
    instead of after the watchdog's wait for an answer."""
    store.set(watchdog_board(number) + f"died/{rank}", json.dumps(
        {"rank": rank, "state": "died", "issued": {}, "waits": [], "inside": None,
         "stack": f"(it {how})"}))


def silent_key(number: int) -> str:
    """Where a rank of round `number` names the ranks that did not answer its watchdog."""
    return f"tandem/elastic/{number}/silent"


def report_silent(store, number: int, ranks: tuple[int, ...], by: int, waited: float) -> None:
    """A rank's wait timed out and `ranks` did not even answer the watchdog's question (a
    stopped or hung process): tell the launcher, which drops them rather than the ranks that
    waited (`launch/agents/elastic.py`)."""
    store.set(silent_key(number), json.dumps({"ranks": list(ranks), "by": by, "waited": waited}))


def ready_key(worker: int) -> str:
    """Set by a new worker once it reached `td.init()`: the launcher then forms the round that
    adds it, so the others never wait while it starts Python and imports torch."""
    return f"tandem/elastic/ready/{worker}"


def settle(store, worker: int, deadline: float) -> tuple[Round, int]:
    """The ranks' side: join the job's newest round that includes this worker, following the
    launcher while it replaces rounds; returns the round and this worker's rank in it, once
    every member has arrived."""
    store.set(ready_key(worker), "1")
    while True:
        number = current_number(store)
        joined = read(store, number)
        rank = joined.rank_of(worker)
        if rank is None:  # a new worker, not in a round yet: wait for the next one
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"elastic: no round included worker {worker} (the newest, "
                                   f"{number}: {joined.why})")
            try:
                store.wait([record_key(number + 1)], timeout=min(1.0, left))
            except TimeoutError:
                pass
            continue
        if arrive(store, joined, worker, deadline):
            return joined, rank
