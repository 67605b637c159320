"""Bad input to `tandem run` (issue 41): a clear error, and nothing lost.

- `--min-np` above the slots the hosts (-H, --hostfile) give: refused before anything starts;
- a discovery script that prints junk, exits non-zero or hangs: refused when it does so before
  the start; named once mid-job, where the job goes on with what it has and ends with the
  one-process result (and a hung script's children are killed with it);
- two agents claiming one node rank, an agent of another job (`--rdzv-id`, which is the job's
  secret across machines) or with another secret: refused, and the job of the others goes on;
  an agent of another job that shares the secret: refused by its job id, both ids named.

The refusals before the start run in this process (`tandem.cli.command.main`, exit 2); the
elastic job and the agents are real `tandem run` processes.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import kill_tree
from streams import Lines

from tandem.cli.command import build_parser, main
from tandem.launch import config_from_args
from tandem.launch.agents.admission import refusal, versions
from tandem.launch.agents.elastic_options import discovery_problem

ROOT = Path(__file__).resolve().parents[1]
ELASTIC_TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")
FAULT_TRAIN = str(ROOT / "tests" / "scripts" / "fault_train.py")
TOUCH = str(ROOT / "tests" / "scripts" / "launch_touch.py")
JOB_S = 90  # one job on two shared cores, start to end


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _gone(pid: int) -> bool:
    """The process `pid` has exited (a zombie that no one reaped yet counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def _until(check, what: str, deadline_s: float = JOB_S, job: subprocess.Popen | None = None):
    """Poll `check` (a file another process makes: there is no event to wait on) until true."""
    deadline = time.monotonic() + deadline_s
    while not check():
        assert job is None or job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


# --- before anything starts ------------------------------------------------------------------

def test_min_np_above_the_slots_the_hosts_give_is_refused_naming_both(capsys, tmp_path):
    marker = tmp_path / "started"
    assert main(["run", "-H", "h1.invalid:1,h2.invalid:1", "-np", "2", "--min-np", "3",
                 TOUCH, str(marker)]) == 2
    assert ("--min-np 3 is more than the 2 slot(s) the hosts h1.invalid:1,h2.invalid:1 "
            "(-H/--hostfile) give") in capsys.readouterr().err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1.invalid slots=2\nh2.invalid\n")
    assert main(["run", "--hostfile", str(hostfile), "--min-np", "4", "--max-np", "6",
                 TOUCH, str(marker)]) == 2
    err = capsys.readouterr().err
    assert ("--min-np 4 is more than the 3 slot(s) the hosts h1.invalid:2,h2.invalid:1 "
            "(-H/--hostfile) give") in err
    assert "lower --min-np to 3 or less, or list more hosts or slots" in err
    assert not marker.exists()


@pytest.mark.parametrize(("body", "said"), [
    ("echo 'Traceback (most recent call last):'\necho localhost:3\n",
     "line 1 is 'Traceback (most recent call last):', not `host:slots`"),
    ("echo localhost:-2\n", "line 1 is 'localhost:-2', not `host:slots`"),
    ("echo 'inventory unreachable' >&2\nexit 3\n", "it exited 3 (inventory unreachable): it must "
                                                   "exit 0"),
    ("sleep 600 &\necho $! >> \"$0.sleepers\"\nwait\n",
     "it ran longer than 0.5 s and was killed (with its children)"),
], ids=["junk", "negative", "exit-3", "hang"])
def test_a_discovery_script_that_fails_its_first_run_is_refused_before_the_start(
        capsys, tmp_path, body, said):
    script = _script(tmp_path / "hosts.sh", body)
    marker = tmp_path / "started"
    assert main(["run", "-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-timeout",
                 "0.5", "--host-discovery-script", str(script), TOUCH, str(marker)]) == 2
    err = capsys.readouterr().err
    assert f"--host-discovery-script {script}: {said}" in err
    assert "Nothing was started; fix the script" in err
    assert not marker.exists()
    sleepers = Path(f"{script}.sleepers")
    if sleepers.exists():  # the hung script's child went with it (SIGKILLed: on a loaded
        # machine it may take the kernel a moment to end it, so within a deadline)
        pids = [int(pid) for pid in sleepers.read_text().split()]
        _until(lambda: all(_gone(pid) for pid in pids), "the hung script's child is gone", 10)


def test_a_discovery_offer_below_min_np_is_said_and_the_job_may_start(capsys, tmp_path):
    """What it offers is not refused: the job starts with -np ranks whatever it says now
    (horovodrun would wait for --min-np slots), and grows when it offers more."""
    script = _script(tmp_path / "hosts.sh", "echo localhost:1\n")
    config = config_from_args(build_parser().parse_args(
        ["run", "-np", "3", "--min-np", "2", "--host-discovery-script", str(script), TOUCH]), {})
    assert discovery_problem(config) is None
    assert (f"--host-discovery-script {script} offers 1 slot(s) now, fewer than --min-np 2: "
            "the job starts with -np 3 rank(s) anyway") in capsys.readouterr().err
    assert main(["run", "-np", "2:3", "--discovery-timeout", "0", TOUCH, "x"]) == 2
    assert "--discovery-timeout 0: give a positive number of seconds" in capsys.readouterr().err


# --- an elastic job whose discovery script goes bad mid-job ----------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "sgd.pt"
    subprocess.run([sys.executable, ELASTIC_TRAIN, str(out)], cwd=ROOT, env=_env(), check=True,
                   timeout=JOB_S)
    return torch.load(out)


@pytest.mark.timeout(240)
def test_a_discovery_script_gone_bad_mid_job_is_named_once_each_way_and_the_job_goes_on(
        tmp_path, one_process):
    """-np 2 of 2..3, the script offering 2 slots. Once the ranks run, it prints junk (a log
    line before its `localhost:3`: read leniently, that would grow the job), then exits 3, then
    hangs past --discovery-timeout; the test moves it on after two runs of each. Each is named
    once; the job neither grows nor stops on them (the ranks reach step 8 meanwhile and wait
    there for a third, up to 60 s). Then it offers 3 slots: the job grows to 3
    at step 8 (where the ranks wait for it) and ends with the one-process parameters."""
    runs, sleepers = tmp_path / "runs", tmp_path / "sleepers"
    script = _script(tmp_path / "slots.sh", f"""d={tmp_path}
if [ -e $d/three ]; then echo localhost:3; exit 0; fi
if [ -e $d/hang ]; then echo hang >> {runs}; sleep 600 & echo $! >> {sleepers}; wait; fi
if [ -e $d/fail ]; then echo fail >> {runs}; echo 'no inventory service' >&2; exit 3; fi
if [ -e $d/junk ]; then echo junk >> {runs}; echo 'Warning: cache stale'; echo localhost:3; fi
echo ok >> {runs}; echo localhost:2
""")
    out = tmp_path / "out.pt"
    job = subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(script), "--discovery-timeout", "1.5", ELASTIC_TRAIN,
         str(out), "--wait-size", "3:8", "--offer", str(tmp_path / "at-step-8")],
        cwd=ROOT, env=_env(TANDEM_TIMEOUT="30"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    errors = Lines(job.stderr)
    phases = [("junk", "line 1 is 'Warning: cache stale', not `host:slots`"),
              ("fail", "it exited 3 (no inventory service): it must exit 0"),
              ("hang", "it ran longer than 1.5 s and was killed (with its children)")]
    try:
        # the run before the start, then the agent's first: the job has started
        _until(lambda: runs.exists() and runs.read_text().split().count("ok") >= 2,
               "the agent's first discovery", job=job)
        for mode, said in phases:
            (tmp_path / mode).touch()
            assert errors.wait_for(said), errors.text()
            _until(lambda m=mode: runs.read_text().split().count(m) >= 2,
                   f"two {mode} runs", job=job)
        # offered at step 8, where the ranks wait for it: a round formed while they are still
        # building their model (before td.elastic.run) fails them today
        _until((tmp_path / "at-step-8").exists, "step 8", job=job)
        (tmp_path / "three").touch()
        assert errors.wait_for(None), errors.text()
        job.wait(JOB_S)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait(10)
    err = errors.text()
    assert job.returncode == 0, err
    for _, said in phases:
        assert err.count(said) == 1, err
    assert err.count("; the job goes on with the hosts it has") == 3, err
    grown = err.index("tandem run: elastic: world 2 -> 3 (round 1): 1 worker(s) joined")
    assert grown > err.index(phases[-1][1]), err  # grown only once it offered 3 slots again
    assert all(_gone(int(pid)) for pid in sleepers.read_text().split())
    result = torch.load(out)
    assert result["sizes"] == [2] * 8 + [3] * 4
    assert result["step"] == one_process["step"] == 12
    for name, expected in one_process["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-5)


# --- agents that node 0 turns away ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agent(node: int, port: int, *identity: str) -> subprocess.Popen:
    """Agent `node` of a fixed --nnodes 3 job; `identity` is its --secret or --rdzv-id."""
    return subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "--nnodes", "3", "--node-rank", str(node),
         "--master", f"127.0.0.1:{port}", *identity, "-np", "1", FAULT_TRAIN, "ok", "--steps",
         "6"], cwd=ROOT, env=_env(TANDEM_TIMEOUT="60"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(240)
def test_a_second_agent_for_a_node_rank_and_agents_of_another_job_or_secret_are_refused():
    """Node 0 of a 3-node job; two agents say --node-rank 1; an agent with another --secret and
    one of another job (--rdzv-id, the secret across machines when no --secret is given) say
    --node-rank 2. Each intruder exits 2 with the reason, node 0 names each; then the real
    node 2 joins and the three nodes train to the end, none the worse."""
    port = _free_port()
    node0 = _agent(0, port, "--secret", "s3cret")
    errors = Lines(node0.stderr)
    ones = [_agent(1, port, "--secret", "s3cret"), _agent(1, port, "--secret", "s3cret")]
    strangers = [_agent(2, port, "--secret", "wrong"), _agent(2, port, "--rdzv-id", "other-job")]
    agents = [node0, *ones, *strangers]
    try:
        refused = []
        for stranger in strangers:
            _, err = stranger.communicate(timeout=JOB_S)
            refused.append((stranger.returncode, err))
        deadline = time.monotonic() + JOB_S
        while all(one.poll() is None for one in ones):  # one of the two is turned away
            assert time.monotonic() < deadline and node0.poll() is None, errors.text()
            time.sleep(0.05)
        duplicate = next(one for one in ones if one.poll() is not None)
        first = next(one for one in ones if one is not duplicate)
        _, duplicate_err = duplicate.communicate(timeout=JOB_S)
        node2 = _agent(2, port, "--secret", "s3cret")
        agents.append(node2)
        results = [agent.communicate(timeout=JOB_S) for agent in (first, node2)]
        assert errors.wait_for(None, JOB_S), errors.text()
        node0.wait(JOB_S)
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
                agent.wait(10)
    err0 = errors.text()
    assert duplicate.returncode == 2, duplicate_err
    assert "node 1 has joined already (two agents with the same --node-rank?)" in duplicate_err
    assert "refused the agent from 127.0.0.1" in err0 and "node 1 has joined already" in err0
    for code, err in refused:
        assert code == 2, err
        assert "does not know this job's secret (the secrets differ)" in err, err
        assert "Give every node the same --secret" in err, err
    assert err0.count("rejected an agent from 127.0.0.1") == 2, err0
    assert node0.returncode == 0, err0
    for agent, (_, err) in zip((first, node2), results, strict=True):
        assert agent.returncode == 0, err
    assert "[0] step 5 loss" in node0.stdout.read()


def test_an_agent_of_another_job_with_the_same_secret_is_refused_naming_both_ids():
    """Two jobs that share a --secret but not a --rdzv-id: node 0 turns the other job's agent
    away (its hello names its job), naming both ids, and keeps waiting for its own node 1."""
    hello = {"node_rank": 1, "nnodes": 2, "nproc": 1, "elastic": False, "job": "job-b",
             **versions()}
    said = refusal(hello, 2, {0}, elastic=False, job="job-a")
    assert "node 1 is an agent of another job (--rdzv-id job-b; node 0 runs --rdzv-id job-a)" \
        in said and "give every node of one job the same --rdzv-id" in said
    assert "no --rdzv-id" in refusal({**hello, "job": None}, 2, {0}, elastic=False, job="job-a")
    assert refusal(hello, 2, {0}, elastic=False, job="job-b") is None

    port = _free_port()

    def agent(node: int, job: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(node),
             "--master", f"127.0.0.1:{port}", "--secret", "shared", "--rdzv-id", job, "-np",
             "1", TOUCH, os.devnull], cwd=ROOT, env=_env(TANDEM_TIMEOUT="60"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    node0 = agent(0, "job-a")
    errors = Lines(node0.stderr)
    stranger = agent(1, "job-b")
    try:
        _, err = stranger.communicate(timeout=JOB_S)
        assert errors.wait_for("refused the agent from 127.0.0.1", JOB_S), errors.text()
        assert node0.poll() is None, errors.text()  # still waiting for its own node 1
    finally:
        for each in (node0, stranger):
            if each.poll() is None:
                kill_tree(each.pid)
                each.wait(10)
    assert stranger.returncode == 2, err
    assert "node 0 refused this agent: node 1 is an agent of another job (--rdzv-id job-b; " \
        "node 0 runs --rdzv-id job-a)" in err, err
    assert "(--rdzv-id job-b; node 0 runs --rdzv-id job-a)" in errors.text(), errors.text()
