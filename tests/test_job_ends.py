"""The end of an elastic job, and a rank that stops answering: real `tandem run` jobs.

- A job whose survivors finish while a new worker is still starting (the discovery script offers
  the lost slot again at once) ends with the survivors' code, the late worker stopped.
- A rank that stops answering (SIGSTOP) is the one that leaves: the healthy ranks' watchdog
  names it, the launcher kills it, and the job goes on with the two others.

Each is one `tandem run` under a bound (`SCENARIO_S`); the result is compared with one process
(`tests/scripts/elastic_train.py`, as in `tests/test_elastic.py`).
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

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")
SCENARIO_S = 90  # one job, start to end, on a loaded machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def tandem_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The job; a job that does not end (or leaves a process holding its output) fails here."""
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=SCENARIO_S)


@pytest.fixture(scope="module")
def one_process():
    """The one-process result (tests/one_process.py: computed once a session; test_elastic.py
    asks for the same run)."""
    return references(TRAIN, ("{out}", "--optimizer", "sgd"))[0]


def assert_same_model(result: dict, reference: dict) -> None:
    assert result["step"] == reference["step"] == 12
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-5)


def test_a_rank_killed_at_the_last_step_with_its_slot_offered_again_the_job_still_ends(
        tmp_path, one_process):
    """Worker 2 dies in the last step; the discovery script offers 3 slots all along, so a new
    worker starts within a discovery period; the survivors train the last step only once its
    process has started (on a fast machine they would otherwise end before discovery runs
    again, and nothing would be joining). Whether it joins before the survivors finish or not,
    the job ends with their code and the one-process result, and nothing it started outlives it."""
    discovery = tmp_path / "slots.sh"
    discovery.write_text("#!/bin/sh\necho localhost:3\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      str(discovery), TRAIN, str(out), "--die", "2:11", "--await-start", "11")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1): rank 2 (worker 2) exit code 9" in done.stderr
    assert "starting 1 worker(s)" in done.stderr
    result = torch.load(out)
    assert result["sizes"][:11] == [3] * 11
    assert_same_model(result, one_process)


def test_a_stopped_rank_is_the_one_dropped_the_job_goes_on_with_the_two_others(
        tmp_path, one_process):
    """Worker 2 stops itself (SIGSTOP) in step 5. The two healthy ranks' wait for it times out
    (TANDEM_TIMEOUT=10); their watchdog names it as the rank that did not answer, the launcher
    kills it (not them) and the job goes on with two ranks to the one-process result."""
    out = tmp_path / "out.pt"
    done = tandem_run("-np", "3", "--min-np", "2", "--max-np", "3", TRAIN, str(out),
                      "--stop", "2:5", TANDEM_TIMEOUT="10")
    assert done.returncode == 0, done.stderr
    assert "tandem run: elastic: rank 2 (worker 2) did not answer rank " in done.stderr
    assert "world 3 -> 2 (round 1): rank 2 (worker 2) stopped answering" in done.stderr
    assert "rank 0 (worker 0)" not in done.stderr and "rank 1 (worker 1)" not in done.stderr
    result = torch.load(out)
    assert result["sizes"] == [3] * 5 + [2] * 7
    assert_same_model(result, one_process)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_fixed_job_names_the_stopped_rank_not_only_the_first_to_fail(backend):
    """Rank 2 of 3 is stopped (SIGSTOP) at step 3: ranks 0 and 1 time out waiting for it and
    exit first, and the summary names rank 2 as the one that stopped answering."""
    script = str(ROOT / "tests" / "scripts" / "stuck_rank.py")
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "3", "--backend", backend,
                           "--timeout", "8", script], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "tandem run: job failed: rank(s) 2 stopped answering" in done.stderr, done.stderr
