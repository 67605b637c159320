"""Which worlds a new round of an elastic job ends (`tandem.rendezvous.elastic_rounds.publish`).

A round's watchdog board gets OVER (its ranks' waits are aborted: `comm.watchdog.monitor`) only
when a later round leaves out one of its workers: its ranks may wait for ever on a lost peer. A
round that only grew leaves every earlier world going: its ranks are healthy and move at their
next commit (tests/test_elastic_grow.py runs that in a real job). The launcher publishes on its
store server; a rank's watchdog reads the board over a store client, as here.
"""

from __future__ import annotations

import time

from tandem.rendezvous import StoreClient, StoreServer, elastic_rounds
from tandem.rendezvous.elastic_rounds import Round


def test_a_round_ends_the_earlier_worlds_that_lost_a_worker_and_no_world_that_only_grew():
    with StoreServer("127.0.0.1", 0) as store:
        rank = StoreClient("127.0.0.1", store.port, store.key, 5.0)

        def over() -> set[int]:
            number = elastic_rounds.current_number(rank)
            return {k for k in range(number + 1)
                    if rank.check([elastic_rounds.watchdog_board(k) + elastic_rounds.OVER])}

        def publish(number: int, workers: tuple[int, ...], why: str) -> None:
            elastic_rounds.publish(store, Round(number, workers, why, time.time()))
            assert elastic_rounds.read(rank, number).workers == workers

        publish(0, (0, 1), "start")
        publish(1, (0, 1, 2), "1 worker(s) joined")
        publish(2, (0, 1, 2, 3), "1 worker(s) joined")
        assert over() == set()  # two grows: ranks still in round 0 or 1 go on
        publish(3, (0, 1, 3), "rank 2 (worker 2) failed: exit code 9")
        assert over() == {1, 2}  # round 0's workers are all in round 3: its ranks are healthy
        publish(4, (0, 1, 3, 4), "1 worker(s) joined")
        assert over() == {1, 2}
        publish(5, (1, 3, 4), "rank 0 (worker 0) failed: exit code 9")
        assert over() == {0, 1, 2, 3, 4}  # worker 0 was in every one of them
        rank.close()
