"""examples/slurm/train.sbatch on a real single-node SLURM (scripts/slurm-local.sh starts it).

Skipped, with the reason, where SLURM cannot start here (not root, no apt-get, no daemons).
"""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


# Two pytest-xdist workers (TEST_WORKERS=2 bash scripts/test.sh) may run this file and
# test_preemption_slurm.py at once: one starts the cluster at a time (an exclusive lock), each
# uses it under a shared lock, and the last to leave stops it if a test started it.
LOCK = Path("/tmp/tandem-slurm-tests.lock")
STARTED = Path("/tmp/tandem-slurm-tests.started")  # the cluster was started by a test


@pytest.fixture(scope="module")
def slurm():
    """A running single-node cluster, or a skip that says why there is none."""
    if os.geteuid() != 0:
        pytest.skip("SLURM: scripts/slurm-local.sh needs root to install and start the daemons")
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode != 0:
            STARTED.touch()  # we start it: leave the machine as we found it
        try:
            started = subprocess.run(["bash", str(ROOT / "scripts" / "slurm-local.sh")],
                                     capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip("SLURM: scripts/slurm-local.sh did not finish in 600 s")
        if started.returncode != 0 or not shutil.which("sbatch"):
            pytest.skip(f"SLURM cannot start here: {started.stderr.strip() or 'no sbatch'}")
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another worker's tests still use it; the last one stops it
        if STARTED.exists():
            subprocess.run(["bash", str(ROOT / "scripts" / "slurm-local.sh"), "stop"], timeout=60)
            STARTED.unlink()


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


def _sbatch(*args, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "SLURM_"))}
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(["sbatch", "--parsable", f"--chdir={ROOT}", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def job_state(job: str) -> dict[str, str]:
    """`scontrol show job` of `job`, as its fields."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                           timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def read_log(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def until_done(job: str, log: Path, within: float) -> dict[str, str]:
    """Poll the job until it reaches a final state (its requeues are not); fail at `within`.
    Not `sbatch --wait`: it looks at the job 2, 10 and 42 s after the submission (its sleep
    grows fourfold to 32 s), so a job of 15 s is seen done at 42 s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = job_state(job)
        if state.get("JobState") in FINAL:
            return state
        time.sleep(0.5)  # a poll interval; the wait itself is bounded by the deadline
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} did not end within {within} s: {job_state(job)}\n"
                         f"{read_log(log)}")


@pytest.mark.timeout(300)
def test_sbatch_job_trains_on_two_tasks_and_oversized_jobs_are_refused(slurm, tmp_path):
    log = tmp_path / "job.out"
    submitted = _sbatch(f"--output={log}", "--time=00:04:00", str(SBATCH), "--epochs", "1",
                        timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    state = until_done(submitted.stdout.strip().split(";")[0], log, within=240)
    text = read_log(log) or "(no output file)"
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, text)
    assert "2 tasks on 1 node(s)" in text and "2 rank(s), global batch 32 = 16 per rank" in text, text
    assert "epoch  1: train loss" in text and "final test accuracy: 0." in text, text
    assert text.count("final test accuracy") == 1, text  # rank 0 reports, rank 1 does not

    cores = os.cpu_count() or 1
    refused = _sbatch(f"--ntasks-per-node={cores + 1}", f"--output={tmp_path}/never.out", str(SBATCH),
                      timeout=60)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "More processors requested than permitted" in refused.stderr, refused.stderr
