"""Elastic jobs (`tandem run --min-np A --max-np B`, `td.elastic`): real ranks die and join.

The central check: a job that loses a rank, or loses one and gains one back (3 -> 2 -> 3), ends
with the parameters of one process that trained on the same global batches
(`tests/scripts/elastic_train.py`: 12 rows per step, made from the step alone, split evenly).
Each scenario is one `tandem run` under a 90 s bound. MPI cannot resize (its world is fixed by
mpiexec): that is refused before anything starts, and `td.elastic.run` inside a job of a
launcher that cannot resize (MPI's, Gloo's fixed -np) is a clear error on both engines.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from one_process import one_process as references

import tandem as td
from tandem.cli.command import main
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")
# The whole elastic path of one scenario, start to end: about 25 s on an idle machine; one took
# over 60 s on a machine at load 30 (a clean-clone CI run beside another suite).
SCENARIO_S = 90


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def tandem_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=SCENARIO_S)


def _slots_script(tmp_path: Path, offered: Path) -> Path:
    """A discovery script that offers 2 slots here, 3 once `offered` exists."""
    discovery = tmp_path / "slots.sh"
    discovery.write_text(f"#!/bin/sh\nif [ -e {offered} ]; then echo localhost:3; "
                         f"else echo localhost:2; fi\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    return discovery


@pytest.fixture(scope="module")
def one_process():
    """The one-process result of the same script, for each optimizer: the four runs in one
    Python process (tests/one_process.py), shared with test_job_ends.py's."""
    configs = (("sgd",), ("adam",), ("adam", "--scheduler"), ("adafactor",))
    results = references(TRAIN, *(("{out}", "--optimizer", *config) for config in configs))
    return {" ".join(config): result for config, result in zip(configs, results, strict=True)}


def assert_same_model(result: dict, reference: dict) -> None:
    assert result["step"] == reference["step"] == 12
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-5)


def test_a_rank_killed_at_step_5_of_3_the_job_goes_on_with_2_and_equals_one_process(
        tmp_path, one_process):
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out),
                      "--die", "2:5")
    assert done.returncode == 0, done.stderr
    assert "tandem run: elastic: world 3 -> 2 (round 1): rank 2 (worker 2) exit code 9" \
        in done.stderr
    assert "tandem elastic: world 3 -> 2 (round 1: rank 2 (worker 2) exit code 9); resumed " \
           "from commit 5" in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process["sgd"])


def test_3_to_2_to_3_a_worker_joins_when_discovery_offers_a_slot_adam_equals_one_process(
        tmp_path, one_process):
    """With a StepLR kept in the State: it steps the real optimizer, is compared by value at
    each commit (three ranks, three scheduler objects) and is sent to the newcomer."""
    offered = tmp_path / "offered"
    discovery = _slots_script(tmp_path, offered)
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      str(discovery), TRAIN, str(out), "--die", "2:5", "--wait-size", "3:8",
                      "--offer", str(offered), "--optimizer", "adam", "--scheduler")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1)" in done.stderr
    assert "tandem run: elastic: world 2 -> 3 (round 2): 1 worker(s) joined" in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 3 + [3] * 4
    assert result["lr"] == pytest.approx(0.01 * 0.5 ** 2)  # StepLR(5, 0.5) after 12 steps
    assert_same_model(result, one_process["adam --scheduler"])


def test_a_rank_that_dies_during_the_resize_shrinks_the_job_again_horovod_api(
        tmp_path, one_process):
    """3 -> 2 at step 5, then worker 1 dies in the reset callbacks of that resize: 2 -> 1,
    written against `tandem.horovod` (hvd.elastic.TorchState, @hvd.elastic.run)."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "1:3", TRAIN, str(out), "--die", "2:5", "--die-in-resize", "1",
                      "--horovod")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1)" in done.stderr
    assert "world 2 -> 1 (round 2): rank 1 (worker 1) exit code 9" in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [1] * 7
    assert_same_model(result, one_process["sgd"])


def test_below_min_np_the_job_ends_with_the_usual_report(tmp_path):
    done = tandem_run("-np", "2", "--min-np", "2", TRAIN, str(tmp_path / "out.pt"),
                      "--die", "1:5")
    assert done.returncode == 9, done.stderr
    assert "tandem run: worker 1 exit code 9; 1 rank(s) left, below --min-np 2: stopping the " \
           "job" in done.stderr
    assert "tandem run: job failed: rank 1 (pid" in done.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_train_function_that_never_commits_warns_once_and_starts_over_exactly_ddp(
        tmp_path, one_process):
    """Written with td.DistributedDataParallel and a plain torch optimizer this time."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", TRAIN, str(out), "--die", "2:5",
                      "--no-commit", "--ddp")
    assert done.returncode == 0, done.stderr
    warning = "the world changed before any State.commit(): the job goes on from the state " \
              "the job started with"
    assert done.stderr.count(warning) == 2  # once on each survivor
    result = torch.load(out)
    assert result["sizes"] == [2] * 12  # everything again, on 2 ranks
    assert_same_model(result, one_process["sgd"])


def test_zero_optimizer_state_is_resharded_in_memory_when_the_job_grows_2_to_3(
        tmp_path, one_process):
    """td.ZeroOptimizer's shards (Adam's moments, 1/N per rank) are cut again for 3 ranks from
    the 2 that hold them: no file is read, and the result is the one process's."""
    out, offered = tmp_path / "out.pt", tmp_path / "offered"
    discovery = _slots_script(tmp_path, offered)
    done = tandem_run("-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      str(discovery), TRAIN, str(out), "--zero", "--optimizer", "adam",
                      "--wait-size", "3:8", "--offer", str(offered))
    assert done.returncode == 0, done.stderr
    assert "world 2 -> 3 (round 1): 1 worker(s) joined" in done.stderr
    assert "checkpoint" not in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [2] * 8 + [3] * 4
    assert_same_model(result, one_process["adam"])


def test_zero_optimizer_state_lost_with_a_rank_comes_from_the_checkpointer(
        tmp_path, one_process):
    """A dead rank takes its ZeroOptimizer shard with it: the job goes on from the
    checkpointer's newest checkpoint (every 4 commits), resharded for 2, exactly."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out), "--zero",
                      "--die", "2:5", "--checkpoint", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr
    assert "the ZeroOptimizer state of flat elements [" in done.stderr
    assert "left with the lost rank(s): going on from the checkpointer's newest checkpoint" \
        in done.stderr
    result = torch.load(out)
    assert result["sizes"][-7:] == [2] * 7 and set(result["sizes"][:5]) <= {2, 3}
    assert_same_model(result, one_process["sgd"])


def test_zero_optimizer_state_lost_without_a_checkpointer_is_named(tmp_path):
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN,
                      str(tmp_path / "out.pt"), "--zero", "--die", "2:5")
    assert done.returncode != 0
    assert "td.elastic: the ZeroOptimizer state of flat elements [" in done.stderr
    assert "was held only by the rank(s) that left" in done.stderr
    assert "checkpointer=td.Checkpointer(dir, every=N)" in done.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_fully_sharded_model_and_its_adam_state_are_cut_again_when_the_job_grows(
        tmp_path, one_process):
    """td.fully_shard (two units) with a plain Adam over the shards: 2 -> 3 ranks, the
    parameters and Adam's moments cut again from the two ranks' parts; no file is read."""
    out, offered = tmp_path / "out.pt", tmp_path / "offered"
    discovery = _slots_script(tmp_path, offered)
    done = tandem_run("-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      str(discovery), TRAIN, str(out), "--fsdp", "--optimizer", "adam",
                      "--wait-size", "3:8", "--offer", str(offered))
    assert done.returncode == 0, done.stderr
    assert "world 2 -> 3 (round 1): 1 worker(s) joined" in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [2] * 8 + [3] * 4
    assert_same_model(result, one_process["adam"])


def test_a_fully_sharded_models_optimizer_state_lost_with_a_rank(tmp_path, one_process):
    """3 -> 2: the lost rank's part of the momentum comes from the checkpointer; without one,
    what was lost is named."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out), "--fsdp",
                      "--die", "2:5", "--checkpoint", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr
    assert "the state of fully_shard's " in done.stderr
    assert "left with the lost rank(s): going on from the checkpointer's newest checkpoint" \
        in done.stderr
    result = torch.load(out)
    assert result["sizes"][-7:] == [2] * 7
    assert_same_model(result, one_process["sgd"])
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN,
                      str(tmp_path / "none.pt"), "--fsdp", "--die", "2:5")
    assert done.returncode != 0
    assert "td.elastic: the state of fully_shard's " in done.stderr
    assert "unit '0' elements [" in done.stderr
    assert "was held only by the rank(s) that left" in done.stderr


@pytest.mark.parametrize("sharding", ["--zero", "--fsdp"])
def test_with_a_peer_backup_sharded_state_lost_with_a_rank_is_restored_from_memory(
        tmp_path, one_process, sharding):
    """State(peer_backup=True): rank 2 also held rank 1's part of each commit, so when rank 1
    dies at step 5 of 3 the job goes on with 2 from commit 5, no file, exactly (Adam)."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out), sharding,
                      "--peer-backup", "--die", "1:5", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1): rank 1 (worker 1) exit code 9" in done.stderr
    assert "resumed from commit 5 (step 5)," in done.stderr and "checkpoint" not in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process["adam"])


@pytest.mark.parametrize("sharding", ["--zero", "--fsdp"])
def test_with_a_peer_backup_a_rank_killed_between_steps_is_restored_from_memory(
        tmp_path, one_process, sharding):
    """The kill the test above does not make: rank 1 dies after step 5's update, before its
    commit, so the others' commit 6 finds no next rank to take their part (or no part from
    the previous rank). The commit does not count until its part was handed on: the survivors
    go on from commit 5, whose parts all survive (before: "held only by the rank(s) that
    left")."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out), sharding,
                      "--peer-backup", "--die-before-commit", "1:5", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1): rank 1 (worker 1) exit code 9" in done.stderr
    assert "resumed from commit 5 (step 5)," in done.stderr and "checkpoint" not in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process["adam"])


def test_zero_adafactor_whole_parameters_peer_backup_3_to_2_equals_one_process(
        tmp_path, one_process):
    """Adafactor under td.ZeroOptimizer: each parameter owned whole by one rank. Rank 1 dies
    at step 5 of 3; its parameters' state comes from rank 2's backup, the parameters are
    owned anew by the 2 left, and the result is the one process's."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out), "--zero",
                      "--peer-backup", "--die", "1:5", "--optimizer", "adafactor")
    assert done.returncode == 0, done.stderr
    assert "resumed from commit 5 (step 5)," in done.stderr and "checkpoint" not in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process["adafactor"])


def test_no_rank_holds_a_commit_the_checkpointer_is_the_fallback_on_another_world_size(
        tmp_path, one_process):
    """A job of 2 stops after 8 steps; a new job of 3 on the same directory holds no commit in
    memory, so it starts from the checkpointer's newest checkpoint (extras included)."""
    ckpt = str(tmp_path / "ckpt")
    first = tandem_run("-np", "2", "--min-np", "1", TRAIN, str(tmp_path / "first.pt"),
                       "--steps", "8", "--checkpoint", ckpt)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "1", TRAIN, str(out), "--checkpoint", ckpt)
    assert done.returncode == 0, done.stderr
    result = torch.load(out)
    assert result["sizes"] == [2] * 8 + [3] * 4
    assert_same_model(result, one_process["sgd"])


def test_ranks_that_commit_different_states_are_named(tmp_path):
    done = tandem_run("-np", "2", "--min-np", "1", TRAIN, str(tmp_path / "out.pt"),
                      "--diverge", "1:3")
    assert done.returncode != 0
    assert "StateMismatchError: td.elastic: ranks committed different states (rank 1: step=4, " \
           "rank 0 step=3)" in done.stderr


def test_a_rank_that_skips_a_commit_is_named_not_averaged(tmp_path):
    done = tandem_run("-np", "2", "--min-np", "1", TRAIN, str(tmp_path / "out.pt"),
                      "--skip-commit", "1:3")
    assert done.returncode != 0
    assert "DivergedError: ranks are in different operations (nothing was sent)" in done.stderr
    assert "rank 0: allgather(shape=(*,), dtype=int64)" in done.stderr
    assert "rank 1: gradient reduction #4 of DistributedOptimizer" in done.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(("args", "message"), [
    (("--min-np", "3", "--max-np", "2"), "--min-np 3 is larger than --max-np 2"),
    (("-np", "4", "--min-np", "1", "--max-np", "3"), "-np 4 is outside --min-np 1 .. --max-np 3"),
    (("-np", "2:3", "--min-np", "2"), "-np 2:3 already gives the range"),
    (("-np", "2", "--min-np", "0"), "--min-np 0: give 1 or more"),
    (("-np", "2:3", "--backend", "mpi"), "an elastic job cannot run on MPI"),
    (("-np", "2:3", "--max-restarts", "1"), "replaces --max-restarts"),
    (("-np", "2:3", "-H", "nosuchhost.invalid:1,localhost:2"),
     "an elastic -H job runs node 0 here: list this machine first"),
    (("--nnodes", "2", "--master", "127.0.0.1:1", "-np", "1:3"),
     "an elastic job across nodes: give each node's ranks with -np N"),
    (("--nnodes", "2", "--master", "127.0.0.1:1", "-np", "4", "--max-np", "3"),
     "-np 4 on this node is more than the job's --max-np 3"),
    (("-np", "2", "--host-discovery-script", "x.sh"), "--host-discovery-script is for elastic"),
    (("-np", "2:3", "--host-discovery-script", "no-such.sh"), "no-such.sh does not exist"),
    (("-np", "2:3", "--host-discovery-script", str(ROOT / "README.md")),
     "is not executable (chmod +x it)"),
])
def test_bad_elastic_options_are_refused_before_anything_starts(args, message, capsys):
    """In this process, as tests/test_launcher.py's refusals: `tandem run` stops before it
    starts anything, so no job (and no Python start of its own) is needed to see it."""
    try:
        code = main(["run", *args, TRAIN, "out.pt"])
    except SystemExit as usage:  # argparse's own refusals
        code = usage.code
    assert code == 2
    assert message in capsys.readouterr().err


def refusals() -> list[str]:
    """What td.elastic says where it cannot work (a job of a launcher that cannot resize)."""
    said = []
    model = torch.nn.Linear(4, 2)
    state = td.elastic.State(model=model, step=0)

    @td.elastic.run
    def train(state):
        return "trained"

    def split(kind: str):
        layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        if kind == "tp":
            return td.elastic.State(model=td.parallelize(layers, {"0": "colwise",
                                                                  "2": "rowwise"}))
        if kind == "pipeline":
            return td.elastic.State(model=td.Pipeline(layers, chunks=2))
        group = td.new_group([0, 1])
        return td.elastic.State(optimizer=td.DistributedOptimizer(
            torch.optim.SGD(layers.parameters(), lr=0.1), group=group))

    for attempt in (lambda: train(state),
                    lambda: td.elastic.State(model=td.fully_shard(
                        torch.nn.Linear(4, 2), group=td.new_group([0, 1]))),
                    lambda: td.elastic.local_rows(9),
                    lambda: train(object()),
                    lambda: split("tp"), lambda: split("pipeline"), lambda: split("group")):
        try:
            attempt()
        except (RuntimeError, ValueError, TypeError) as error:
            said.append(str(error))
    return said


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_td_elastic_where_the_world_cannot_change_says_so(backend):
    for said in run_distributed(refusals, world_size=2, backend=backend):
        assert len(said) == 7, said
        assert "td.elastic.run needs a launcher that can resize the job" in said[0]
        assert "tandem run --min-np A --max-np B" in said[0]
        assert "Linear is split (fully_shard): its ranks hold different parts" in said[1]
        assert "9 rows do not split evenly over 2 ranks" in said[2]
        assert "takes a td.elastic.State first, got object" in said[3]
        assert "is split (tensor parallel)" in said[4]
        assert "Pipeline is split (pipeline)" in said[5]
        assert "DistributedOptimizer is reduced over" in said[6] and "not the world" in said[6]


# --- across nodes: one agent per machine (localhost agents, as tests/test_multinode.py) -------

def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node(rank: int, port: int, np: int, *args: str) -> subprocess.Popen:
    """`tandem run --nnodes 2` agent `rank` of an elastic job of 2 to 3 ranks."""
    return subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(rank),
         "--master", f"127.0.0.1:{port}", "--secret", "s3cret", "--min-np", "2", "--max-np", "3",
         "-np", str(np), *args], cwd=ROOT, env={**_env(), "TANDEM_TIMEOUT": "10"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _appears(path: Path, agents: list[subprocess.Popen], deadline_s: float = SCENARIO_S) -> None:
    """Wait for rank 0 to create `path` (an event, polled with a deadline: no fixed sleep)."""
    import time

    deadline = time.monotonic() + deadline_s
    while not path.exists():
        finished = [a for a in agents if a.poll() is not None]
        assert not finished, [a.communicate() for a in finished]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _outcome(agent: subprocess.Popen) -> tuple[int, str]:
    """The job's exit code and stderr; a job still running after SCENARIO_S fails the test with
    what it printed (slow or hung, the log tells which), and nothing of it is left running."""
    from helpers import kill_tree

    try:
        _, err = agent.communicate(timeout=SCENARIO_S)
    except subprocess.TimeoutExpired:
        kill_tree(agent.pid)
        _, err = agent.communicate(timeout=10)
        pytest.fail(f"the job did not end within {SCENARIO_S} s; it printed:\n{err[-4000:]}")
    return agent.returncode, err


def test_a_node_that_vanishes_leaves_the_job_on_the_other_and_equals_one_process(
        tmp_path, one_process):
    """3 ranks on 2 machines (2 + 1); node 1's machine vanishes (its agent and rank killed)
    at step 5: node 0 goes on with 2 ranks, exactly."""
    from helpers import kill_tree

    port, out, marker = _free_port(), tmp_path / "out.pt", tmp_path / "at-step-5"
    job = [TRAIN, str(out), "--wait-size", "2:5", "--offer", str(marker)]
    node0 = _node(0, port, 2, *job)
    node1 = _node(1, port, 1, *job)
    _appears(marker, [node0, node1])
    kill_tree(node1.pid)
    code, err = _outcome(node0)
    node1.communicate()
    assert code == 0, err
    assert "tandem run: elastic: node 1 (" in err and "joined with 1 slot(s)" in err
    assert "tandem run: elastic: world 3 -> 2 (round 1): node 1 (" in err
    assert "is unreachable" in err
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process["sgd"])


def test_a_node_that_joins_mid_job_grows_it_to_3_adam_equals_one_process(tmp_path, one_process):
    """Node 0 starts alone with 2 ranks; at step 8 node 1's agent joins with one slot: the
    job grows to 3 at the next commit, exactly."""
    port, out, marker = _free_port(), tmp_path / "out.pt", tmp_path / "at-step-8"
    job = [TRAIN, str(out), "--wait-size", "3:8", "--offer", str(marker), "--optimizer", "adam"]
    node0 = _node(0, port, 2, *job)
    _appears(marker, [node0])
    node1 = _node(1, port, 1, *job)
    code, err = _outcome(node0)
    code1, err1 = _outcome(node1)
    assert code == 0, err
    assert code1 == 0, err1
    assert "tandem run: elastic: node 1 (" in err and "joined; starting 1 worker(s)" in err
    assert "tandem run: elastic: world 2 -> 3 (round 1): 1 worker(s) joined" in err
    result = torch.load(out)
    assert result["sizes"] == [2] * 8 + [3] * 4
    assert_same_model(result, one_process["adam"])


def test_an_agent_of_a_fixed_job_is_refused_by_an_elastic_node_0(tmp_path):
    port = _free_port()
    node0 = _node(0, port, 2, TRAIN, str(tmp_path / "out.pt"))
    fixed = subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", "1", "--master",
         f"127.0.0.1:{port}", "--secret", "s3cret", "-np", "1", TRAIN, str(tmp_path / "x.pt")],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code1, err1 = _outcome(fixed)
    code, err = _outcome(node0)
    assert code1 == 2, err1
    assert "node 0 runs an elastic job (--min-np/--max-np)" in err1
    assert code == 0, err  # it went on with its own 2 ranks


def test_an_h_job_loses_a_host_and_grows_back_when_discovery_lists_it_again(tmp_path, one_process):
    """-H localhost:2,127.0.0.1:1: node 0 starts the second host's agent itself (no ssh for a
    local name). At step 5 that host vanishes (its agent and rank killed): 3 -> 2. The
    discovery script still lists it, so node 0 starts an agent there again: 2 -> 3 by step 8.
    The parameters are the one process's."""
    import time

    from helpers import kill_tree

    out, marker = tmp_path / "out.pt", tmp_path / "at-step-5"
    discovery = tmp_path / "hosts.sh"
    discovery.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    job = subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "-H", "localhost:2,127.0.0.1:1", "-np", "3",
         "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discovery), TRAIN,
         str(out), "--wait-size", "2:5,3:8", "--offer", str(marker)],
        cwd=ROOT, env={**_env(), "TANDEM_TIMEOUT": "10"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    _appears(marker, [job])
    deadline = time.monotonic() + SCENARIO_S
    agent = None
    while agent is None:
        found = subprocess.run(["pgrep", "-P", str(job.pid), "-f", "--", "--node-rank 1 "],
                               capture_output=True, text=True).stdout.split()
        agent = int(found[0]) if found else None
        assert agent is not None or time.monotonic() < deadline, "no agent for node 1"
    kill_tree(agent)
    code, err = _outcome(job)
    assert code == 0, err
    assert "world 3 -> 2 (round 1): node 1 (" in err and "is unreachable" in err
    assert "world 2 -> 3 (round 2): 1 worker(s) joined" in err
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 3 + [3] * 4
    assert_same_model(result, one_process["sgd"])
