"""One agent, one watch: every `tandem run` job is a case of the same loop.

A plain local job, a job with restarts and an elastic one are watched by one `Supervisor`
(launch/local/supervisor.py), whose policy is the job's, not a subclass's: a failed rank
stops a fixed job and shrinks an elastic one while `--min-np` ranks are left, so a fixed job
is the case min = max, where no round without a rank is ever big enough; an elastic MPI job
is the plain case whose world shrinks in place, down to `--min-np` (the watch's `low`). These cases drive the
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
from tandem.launch.events import JobState, RankExited, SilentRanks
from tandem.launch.local.ranks import LocalRanks
from tandem.launch.local.supervisor import Supervisor
from tandem.launch.mpi.shrinking import ShrinkingRanks
from tandem.rendezvous.elastic_rounds import current_number, read


def placeholder_ranks(ranks: LocalRanks, count: int) -> None:
    """`count` live ranks whose pids name no process (signals to them go nowhere)."""
    ranks.live = set(range(count))
    ranks.pids = {rank: os.getpid() + 10**7 + rank for rank in range(count)}


def agent(config: LaunchConfig, rounds: type | None = None,
          ranks: type[LocalRanks] = LocalRanks) -> tuple[Coordinator, io.StringIO]:
    said = io.StringIO()
    job = Coordinator(config, nproc=config.np, rounds=rounds, ranks=ranks, stdout=io.StringIO(),
                      stderr=said)
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
                           host="here", nodes=restarted.nodes)
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



def test_an_elastic_mpi_job_is_the_plain_case_whose_watch_drops_ranks_in_place_to_min_np():
    # (the config names no backend: on MPICH `--backend mpi --min-np` is refused before any
    # agent exists, test_mpi_elastic.py; the agent and its watch are the same on Open MPI)
    config = LaunchConfig(np=3, program="t.py", min_np=2, max_np=3)
    job, said = agent(config, ranks=ShrinkingRanks)
    try:
        assert job.plain and job.rounds is None  # one machine, mpiexec's ranks, no rounds
        placeholder_ranks(job.ranks, 3)
        pid = job.ranks.pids[2]
        watch = Supervisor(job.ranks, job.events, job.output, low=2)
        # td.elastic.run's report of a rank that did not answer the watchdog: it is killed...
        watch.handle(SilentRanks(1, {"workers": [2], "by": 0, "waited": 10.0}))
        assert f"rank 2 (pid {pid}) did not answer rank 0's watchdog after a 10 s wait: " \
               "killing it (SIGKILL)" in said.getvalue()
        watch.handle(RankExited(2, -9))  # ... and its exit drops it: three -> two, at --min-np
        assert watch.state is JobState.RUNNING and watch.failure is None
        assert f"elastic: world 3 -> 2: rank 2 (pid {pid}) stopped answering (rank 0's wait " \
               "for it timed out after 10 s" in said.getvalue()
        watch.handle(RankExited(0, 0))
        watch.handle(RankExited(1, 0))
        assert watch.run() is None and watch.state is JobState.SUCCEEDED
        assert watch.shrunk(3).startswith("tandem run: elastic: the job ended on 2 of 3 ranks "
                                          "(--min-np 2), without rank 2 (pid ")
    finally:
        job.close()
    job, said = agent(config, ranks=ShrinkingRanks)
    try:
        placeholder_ranks(job.ranks, 3)
        watch = Supervisor(job.ranks, job.events, job.output, low=2)
        watch.handle(RankExited(2, 1))
        watch.handle(RankExited(1, 1))  # one left, below --min-np: stopped as a fixed job is
        assert watch.state is JobState.STOPPING and watch.failure.rank == 1
        assert "rank 1 exit code 1; 1 rank(s) left, below --min-np 2: stopping the job" \
            in said.getvalue()
    finally:
        job.close()
