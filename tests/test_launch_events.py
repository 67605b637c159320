"""The launch agents' typed events and job state, and the one rank-environment builder.

Every thread of an agent puts a typed event on its queue (`tandem.launch.events`); the rank
supervisor's `JobState` moves forwards only, in one place (`Supervisor.advance`). `tandem run`,
`td.spawn` and `tandem.testing`'s shared worlds build their ranks' environments with one
function and one thread rule (`launch.local.ranks.local_rank_environment`, `thread_limits`).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import signal

import pytest

from tandem.launch import LaunchConfig
from tandem.launch.events import JobState, Lost, Message, RankExited, Signalled, message
from tandem.launch.local.output import RankOutput
from tandem.launch.local.processes import cores
from tandem.launch.local.ranks import (
    LocalRanks,
    Placement,
    local_rank_environment,
    rank_environment,
    thread_limits,
)
from tandem.launch.local.supervisor import Supervisor
from tandem.testing import run_distributed

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(not HAVE_MPI, reason="no mpi4py"))]


def test_a_peers_words_become_typed_messages_and_junk_is_named_as_such():
    assert message(2, ("exit", {"rank": 3})) == Message(2, "exit", {"rank": 3})
    assert message(1, ("stop",)) == Message(1, "stop", {})
    assert message(1, "junk").kind == "?" and message(1, ("x", "not a dict")).body == {}
    match Lost(3, "its connection closed"):
        case Lost(node, why):
            assert (node, why) == (3, "its connection closed")


def test_the_job_state_moves_forwards_only_and_ends_once():
    config = LaunchConfig(np=1, program="t.py")
    events: queue.SimpleQueue = queue.SimpleQueue()
    watch = Supervisor(LocalRanks(config, events, RankOutput()), events, RankOutput())
    assert watch.state is JobState.RUNNING and not watch.stopping
    watch.stop(None)  # no live ranks: nothing to signal, but the grace starts
    assert watch.state is JobState.STOPPING and watch.deadline is not None
    watch.kill()
    assert watch.killed and watch.state is JobState.KILLING
    assert watch.run() is None  # nothing live, nothing else running: over at once
    assert watch.state is JobState.SUCCEEDED and watch.state.done
    with pytest.raises(AssertionError, match="cannot go from SUCCEEDED to RUNNING"):
        watch.advance(JobState.RUNNING)


def test_a_rank_exit_and_a_signal_are_handled_as_typed_events():
    config = LaunchConfig(np=2, program="t.py")
    events: queue.SimpleQueue = queue.SimpleQueue()
    ranks = LocalRanks(config, events, RankOutput())
    ranks.live = {0, 1}
    ranks.pids = {0: os.getpid() + 10**7, 1: os.getpid() + 10**7 + 1}  # no such processes
    watch = Supervisor(ranks, events, RankOutput())
    watch.handle(RankExited(1, 0))
    assert ranks.live == {0} and watch.state is JobState.RUNNING
    watch.handle(Signalled(signal.SIGTERM))
    assert watch.state is JobState.STOPPING and watch.failure.interrupt == signal.SIGTERM
    watch.handle(Signalled(signal.SIGTERM))  # a second signal: no more grace
    assert watch.state is JobState.KILLING


def test_one_thread_rule_for_every_rank_tandem_starts():
    share = str(max(1, cores() // 4))
    assert thread_limits({}, 4) == {"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}
    assert thread_limits({"OMP_NUM_THREADS": "7"}, 4) == {"MKL_NUM_THREADS": share}
    assert thread_limits({"OMP_NUM_THREADS": "7"}, 4, per_rank=2) == {
        "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    env = local_rank_environment({"OMP_NUM_THREADS": "7"}, rank=1, size=4, local_rank=1,
                                 local_size=4, store=("127.0.0.1", 1234), store_key="k",
                                 backend="gloo")
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("7", share)
    assert (env["TANDEM_RANK"], env["TANDEM_SIZE"], env["TANDEM_LOCAL_SIZE"]) == ("1", "4", "4")
    assert (env["TANDEM_MASTER_PORT"], env["TANDEM_STORE_KEY"]) == ("1234", "k")
    # tandem run's ranks: the same variables, from the same builder, plus the job's own
    ran = rank_environment(LaunchConfig(np=4, program="t.py", backend="gloo"), 1,
                           Placement.single(4, 1234, "k"), {"OMP_NUM_THREADS": "7"})
    assert {name: ran[name] for name in env if name.startswith(("TANDEM_", "OMP", "MKL"))} == {
        name: value for name, value in env.items() if name.startswith(("TANDEM_", "OMP", "MKL"))}



def test_an_mpi_ranks_supervisor_builds_its_environment_with_the_one_builder():
    """Under `tandem run --backend mpi` each rank's supervisor (launch/mpi/rank.py) gives its
    program the place mpiexec gave it through the same builder and thread rule as a local rank:
    tandem's, horovodrun's and torchrun's variables, the agent's store, TANDEM_UNDER_MPI."""
    from tandem.launch.mpi import rank as mpi_rank

    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    base = {**hydra, "OMP_NUM_THREADS": "3", "TANDEM_STORE_KEY": "k", "TANDEM_LAUNCH_TOKEN": "t"}
    env = mpi_rank._child_environment(mpi_rank._mpi_job(base), ("127.0.0.1", 4321), base,
                                      torch_port=5555, run_id="tandem-x")
    local = local_rank_environment(
        {k: v for k, v in base.items() if k != "TANDEM_LAUNCH_TOKEN"}, rank=1, size=2,
        local_rank=1, local_size=2, store=("127.0.0.1", 4321), backend="mpi", under_mpi=True,
        torch=dict(node=0, nodes=1, master_port=5555, run_id="tandem-x"))
    assert env == local
    assert (env["TANDEM_RANK"], env["HOROVOD_RANK"], env["RANK"], env["MASTER_PORT"]) == (
        "1", "1", "1", "5555")
    assert (env["TANDEM_UNDER_MPI"], env["TANDEM_STORE_KEY"], env["OMP_NUM_THREADS"]) == (
        "1", "k", "3")
    assert env["MKL_NUM_THREADS"] == str(max(1, cores() // 2))  # the rule: cores / local ranks

def check_world_environment():
    import tandem as td

    return td.rank(), os.environ["OMP_NUM_THREADS"], os.environ["MKL_NUM_THREADS"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_worlds_ranks_run_one_thread_each_by_the_one_rule(backend):
    results = run_distributed(check_world_environment, world_size=2, backend=backend)
    assert results == [(rank, "1", "1") for rank in range(2)]


def test_a_rank_named_silent_is_known_after_a_report_longer_than_the_kept_tail():
    """A watchdog report carries a stack per rank, so the line naming the rank that stopped
    answering may be far above the last lines kept: the summary still names it."""
    from tandem.launch.local.failure import silent_ranks
    from tandem.launch.local.output import TAIL_LINES

    output = RankOutput(echo=False)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    output.attach(0, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
    os.close(out_write)
    report = ["tandem watchdog: rank 0 waited 8.0 s for allreduce #7 on the world",
              "    rank 2: did not answer the watchdog (its process died, ...)",
              *(f'  File "train.py", line {n}, in step' for n in range(2 * TAIL_LINES))]
    with os.fdopen(err_write, "w") as err:
        err.write("\n".join(report) + "\n")
    assert output.join(10)
    assert not any("did not answer" in line for line in output.tail(0))
    assert silent_ranks(output, 3) == (2,)
    assert silent_ranks(output, 2) == ()  # a rank outside the job is not named
