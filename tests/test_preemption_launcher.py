"""`tandem run` passes a scheduler's preemption signal on and says "resume me" (issue 44).

SIGUSR1 to the launcher (what `#SBATCH --signal=B:USR1@120` sends the batch shell) reaches every
rank; the ranks agree on a step, save there and exit 75; the launcher waits for the save (the
preemption lead, not the 2 s of a Ctrl-C) and exits 75 too. The next run, on another number of
ranks, resumes at the exact sample and ends with the one-process parameters.

`tandem run --resume-on-preempt N` does that restart itself: SIGTERM to the launcher mid-epoch,
the ranks save and exit 75, the launcher starts the job again, and it ends with exit 0 and the
one-process parameters (Gloo and MPI). Two signals in a row stop it for good.
"""

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from one_process import one_process as references

from tandem.job.preemption import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "preemptible_train.py")
JOB_S = 120
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def one_process() -> dict:
    """The script's parameters after one uninterrupted process: run once a session
    (tests/one_process.py), for this module's tests and test_preemption_stress.py's."""
    return references(SCRIPT, ("{dir}", "{out}"))[0]


@pytest.fixture(scope="module")
def reference():
    return one_process()


def _until_step(job: subprocess.Popen, step: int) -> None:
    """Read the job's output until rank 0 printed `step N` (or fail at the deadline)."""
    _until_line(job, job.stdout, lambda line: line.strip() == f"[0] step {step}", f"step {step}")


def _until_line(job: subprocess.Popen, pipe, found, what: str) -> None:
    """Read `pipe` (the job's stdout or stderr) until `found(line)`, or fail at the deadline."""
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([pipe], [], [], deadline - time.monotonic())
        line = pipe.readline() if ready else ""
        if found(line):
            return
        assert line or job.poll() is None, f"the job ended before {what}"
    raise AssertionError(f"no {what} within {JOB_S} s")


def test_sigusr1_to_tandem_run_saves_exits_75_and_the_next_run_resumes_exactly(tmp_path,
                                                                            reference):
    directory, out = tmp_path / "ckpt", tmp_path / "out.pt"
    job = subprocess.Popen([sys.executable, "-m", "tandem", "run", "-np", "2", SCRIPT,
                            str(directory), str(out)], env=_env(), cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _until_step(job, 3)
        job.send_signal(signal.SIGUSR1)
        _, stderr = job.communicate(timeout=JOB_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == EXIT_PREEMPTED, stderr
    assert "tandem run: preempted" in stderr and "resume me" in stderr, stderr
    assert not out.exists()  # it stopped mid-training
    resumed = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "3", SCRIPT,
                              str(directory), str(out)], env=_env(), cwd=ROOT, text=True,
                             capture_output=True, timeout=JOB_S)
    assert resumed.returncode == 0, resumed.stderr
    first = int(resumed.stdout.split("step ", 1)[1].split()[0])
    assert first > 3  # resumed where it stopped, not from the start
    for name, expected in reference.items():
        torch.testing.assert_close(torch.load(out)[name], expected, rtol=0, atol=1e-6)


def _resumable(backend: str, directory: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem", "run", "-np", "2", "--backend",
                             backend, "--resume-on-preempt", "2", SCRIPT, str(directory),
                             str(out)], env=_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_on_preempt_restarts_after_sigterm_and_ends_as_one_process(tmp_path, backend,
                                                                          reference):
    out = tmp_path / "out.pt"
    job = _resumable(backend, tmp_path / "ckpt", out)
    try:
        _until_step(job, 3)
        job.send_signal(signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=2 * JOB_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert "starting the job again (1 of 2, --resume-on-preempt 2)" in stderr, stderr
    # After step 3, both runs' steps: the second resumed where the first saved (no step
    # again, none from the start), and ended after 4 epochs of 8 steps.
    steps = [int(line.split()[-1]) for line in stdout.splitlines() if "] step " in line]
    assert steps == sorted(set(steps)) and steps[0] > 3 and steps[-1] == 32, steps
    for name, expected in reference.items():
        torch.testing.assert_close(torch.load(out)[name], expected, rtol=0, atol=1e-6)


def test_a_second_signal_to_the_launcher_stops_for_good(tmp_path):
    out = tmp_path / "out.pt"
    job = _resumable("gloo", tmp_path / "ckpt", out)
    try:
        _until_step(job, 3)
        job.send_signal(signal.SIGTERM)
        # The second once the first was heard (two at once may reach it as one signal).
        _until_line(job, job.stderr, lambda line: "received SIGTERM" in line, "the first heard")
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=JOB_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode in (EXIT_PREEMPTED, 128 + signal.SIGTERM), stderr
    assert "starting the job again" not in stderr, stderr
    assert not out.exists()


@pytest.mark.parametrize("slurm", [False, True])
def test_resume_on_preempt_is_bounded_and_leaves_slurm_to_its_requeue(tmp_path, slurm):
    """A job that is preempted every time is started 1 + N times, then stops naming the
    option; under SLURM (the job requeues itself) it is not restarted here."""
    attempts = tmp_path / "attempts"
    script = tmp_path / "always_preempted.py"
    script.write_text(f"open({str(attempts)!r}, 'a').write('x')\nraise SystemExit(75)\n")
    env = {**_env(), **({"SLURM_JOB_ID": "4242"} if slurm else {})}
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "1", "--backend",
                           "gloo", "--resume-on-preempt", "2", str(script)], env=env, cwd=ROOT,
                          text=True, capture_output=True, timeout=JOB_S)
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert attempts.read_text() == ("x" if slurm else "xxx")
    said = ("under SLURM (job 4242) the job requeues itself" if slurm else
            "it was restarted 2 time(s) already (--resume-on-preempt 2)")
    assert f"not restarting: {said}" in done.stderr, done.stderr
