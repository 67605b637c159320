"""One agent, one watch: every `tandem run` job is a case of the same loop.

A plain local job, a job with restarts and an elastic one are watched by one `Supervisor`
(launch/local/supervisor.py), whose policy is the job's, not a subclass's: a failed rank
stops a fixed job and shrinks an elastic one while `--min-np` ranks are left, so a fixed job
is the case min = max, where no round without a rank is ever big enough. These cases drive the
watch with typed events around the agent's real store and node table (no processes: the
ranks are placeholders with pids that do not exist); the jobs themselves are tested end to end
in test_launcher.py, test_restart.py, test_elastic.py and test_multinode.py.
"""

from __future__ import annotations

import io
import os
import time

from tandem.launch import LaunchConfig
from tandem.launch.agents.coordinator import Coordinator
from tandem.launch.agents.elastic import Rounds
from tandem.launch.events import JobState, RankExited
from tandem.launch.local.ranks import LocalRanks
from tandem.launch.local.supervisor import Supervisor
from tandem.rendezvous.elastic_rounds import current_number, read


def placeholder_ranks(ranks: LocalRanks, count: int) -> None:
    """`count` live ranks whose pids name no process (signals to them go nowhere)."""
    ranks.live = set(range(count))
    ranks.pids = {rank: os.getpid() + 10**7 + rank for rank in range(count)}


def agent(config: LaunchConfig, rounds: type | None = None) -> tuple[Coordinator, io.StringIO]:
    said = io.StringIO()
    job = Coordinator(config, nproc=config.np, rounds=rounds, stdout=io.StringIO(), stderr=said)
    job.open_store()  # the job's store (no other nodes)
    return job, said


def test_every_local_job_is_the_one_agent_and_only_its_words_differ():
    plain, said = agent(LaunchConfig(np=3, program="t.py"))
    try:
        assert plain.plain and plain.rounds is None  # one machine, no restarts, min = max
        placeholder_ranks(plain.ranks, 3)
        watch = Supervisor(plain.ranks, plain.events, plain.output)
        watch.handle(RankExited(2, 75))  # saved at the agreed step: a preemption, not a failure
        assert watch.preempted == {2} and watch.state is JobState.RUNNING
        watch.handle(RankExited(1, 3))
        assert watch.state is JobState.STOPPING and watch.failure.rank == 1
        assert "rank 1 failed: exit code 3; stopping the other 1 rank(s)" in said.getvalue()
    finally:
        plain.close()
    restarted, said = agent(LaunchConfig(np=3, program="t.py", max_restarts=1))
    try:
        assert not restarted.plain
        placeholder_ranks(restarted.ranks, 3)
        watch = Supervisor(restarted.ranks, restarted.events, restarted.output, node=0,
                           host="here", nodes=restarted.nodes, offsets={0: 0})
        watch.handle(RankExited(2, 75))  # with restarts, any non-zero exit fails the attempt
        assert watch.state is JobState.STOPPING and watch.failure.node == 0
        assert "rank 2 failed: exit code 75; stopping every rank of the job" in said.getvalue()
    finally:
        restarted.close()


def test_a_failed_rank_shrinks_an_elastic_job_until_min_np_then_stops_it_like_a_fixed_one():
    job, said = agent(LaunchConfig(np=3, program="t.py", min_np=2, max_np=3), rounds=Rounds)
    try:
        rounds = job.rounds
        rounds.publish([0, 1, 2], "start", time.time())
        job.nodes.nodes[0].workers.update({0: 0, 1: 1, 2: 2})
        placeholder_ranks(job.ranks, 3)
        watch = Supervisor(job.ranks, job.events, job.output, rounds=rounds)
        watch.handle(RankExited(2, 9))  # three -> two: at --min-np, the job goes on
        assert watch.state is JobState.RUNNING and watch.failure is None
        assert current_number(job.store) == 1 and read(job.store, 1).workers == (0, 1)
        assert "elastic: world 3 -> 2 (round 1): rank 2 (worker 2) exit code 9" in said.getvalue()
        watch.handle(RankExited(1, 9))  # two -> one: below --min-np, stopped as a fixed job is
        assert watch.state is JobState.STOPPING and watch.failure.rank == 1
        assert current_number(job.store) == 1
        assert "below --min-np 2: stopping the job" in said.getvalue()
    finally:
        job.close()

