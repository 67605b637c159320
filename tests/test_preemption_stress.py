"""SIGTERM to an MPI job's launcher, and signals at the riskiest moments (issue 44, item 4).

`tandem run --backend mpi` and a plain `mpiexec` pass SIGTERM on to every rank; the ranks save
at the step they agree on and exit 75, and the rerun, on another number of ranks, resumes at
the exact sample and ends with the one-process parameters. The stress run
(benchmarks/preemption_stress.py, small here) signals a 2-rank job during a save, twice in a
row and during its start-up, on Gloo and MPI: every job ends (no hang) with a checkpoint that
loads and passes its checksums, at most one step lost, and the chain ends as one process.
"""

import importlib.util
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_preemption_launcher import JOB_S, SCRIPT, _env, one_process

import tandem as td
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.testing import mpiexec_command

ROOT = Path(__file__).resolve().parents[1]
STRESS = ROOT / "benchmarks" / "preemption_stress.py"
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="no mpi4py")


@pytest.fixture(scope="module")
def reference():
    """The one-process parameters: test_preemption_launcher.py's run, if it ran (one a session)."""
    return one_process()


def _until_step(job: subprocess.Popen, step: int) -> None:
    """Read the job's output until rank 0 printed `step N` (`[0] step N` under tandem run; plain
    mpiexec does not prefix), or fail at the deadline."""
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([job.stdout], [], [], deadline - time.monotonic())
        line = job.stdout.readline() if ready else ""
        if line.strip() in (f"[0] step {step}", f"step {step}"):
            return
        assert line or job.poll() is None, f"the job ended before step {step}"
    raise AssertionError(f"no step {step} within {JOB_S} s")


def _stopped_by_sigterm(command: list[str]) -> tuple[int, str]:
    """Start `command`, SIGTERM it once rank 0 finished step 3; (exit status, stderr)."""
    job = subprocess.Popen(command, env={k: v for k, v in _env().items() if not k.startswith("PMI_")},
                           cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _until_step(job, 3)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=JOB_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
    return job.returncode, stderr


def _check_resumed(resumed: subprocess.CompletedProcess, out: Path, reference: dict) -> None:
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    first = int(resumed.stdout.split("step ", 1)[1].split()[0])
    assert first > 3, resumed.stdout  # resumed where it stopped, not from the start
    for name, expected in reference.items():
        torch.testing.assert_close(torch.load(out)[name], expected, rtol=0, atol=1e-6)


@needs_mpi
def test_sigterm_to_tandem_run_mpi_saves_exits_75_and_the_next_run_resumes_exactly(tmp_path,
                                                                                   reference):
    directory, out = tmp_path / "ckpt", tmp_path / "out.pt"
    run = [sys.executable, "-m", "tandem", "run", "--backend", "mpi"]
    code, stderr = _stopped_by_sigterm([*run, "-np", "2", SCRIPT, str(directory), str(out)])
    assert code == EXIT_PREEMPTED, stderr
    assert "tandem run: preempted" in stderr and "resume me" in stderr, stderr
    assert not out.exists()  # it stopped mid-training
    resumed = subprocess.run([*run, "-np", "3", SCRIPT, str(directory), str(out)], env=_env(),
                             cwd=ROOT, text=True, capture_output=True, timeout=JOB_S)
    _check_resumed(resumed, out, reference)


@needs_mpi
def test_sigterm_to_plain_mpiexec_saves_exits_75_and_the_next_run_resumes_exactly(tmp_path,
                                                                                  reference):
    directory, out = tmp_path / "ckpt", tmp_path / "out.pt"
    code, stderr = _stopped_by_sigterm([*mpiexec_command(2), sys.executable, "-u", SCRIPT,
                                        str(directory), str(out)])
    assert code == EXIT_PREEMPTED, stderr
    assert "preempted (SIGTERM)" in stderr and "saved" in stderr, stderr
    assert not out.exists()
    env = {k: v for k, v in _env().items() if not k.startswith("PMI_")}
    resumed = subprocess.run([*mpiexec_command(3), sys.executable, "-u", SCRIPT, str(directory),
                              str(out)], env=env, cwd=ROOT, text=True, capture_output=True,
                             timeout=JOB_S)
    _check_resumed(resumed, out, reference)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_signals_during_a_save_twice_in_a_row_and_at_start_up_lose_at_most_one_step(
        tmp_path, backend):
    out = tmp_path / "stress.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(STRESS), "--signals", "4", "--backends", backend,
                           "--moments", "save,twice,startup,save", "--seed", "1",
                           "--out", str(out)], env=_env(), cwd=ROOT, text=True,
                          capture_output=True, timeout=840)
    assert out.exists(), done.stdout + done.stderr
    result = json.loads(out.read_text())
    row = result["summary"][backend]
    assert row["signals_sent"] == 4 and row["torn"] == 0 and row["hangs"] == 0, done.stdout
    assert row["steps_lost_max"] <= 1 and row["bad_exit"] == 0, done.stdout + done.stderr
    assert row["saves_completed"] >= 1, done.stdout  # the save-time signals saved
    assert row["final_max_diff"] is not None and row["final_max_diff"] <= 1e-6, done.stdout
    assert done.returncode == 0, f"{done.stdout}{done.stderr} ({time.monotonic() - started:.0f} s)"


_TWICE = """
import os, signal, sys
import torch
import tandem as td
ckpt = td.Checkpointer(sys.argv[1])
model = torch.nn.Linear(2, 2)
ckpt.save(0, model=model)                      # a boundary
os.kill(os.getpid(), signal.SIGTERM)           # a time limit: SLURM signals the task,
os.kill(os.getpid(), signal.SIGTERM)           # and srun passes the same signal on
ckpt.save(1, model=model)                      # the agreed save, then exit 75
print("not reached")
"""


def test_the_same_signal_delivered_twice_at_once_is_one_signal_and_the_save_is_made(tmp_path):
    done = subprocess.run([sys.executable, "-c", _TWICE, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert "stopping now" not in done.stderr and "preempted (SIGTERM)" in done.stderr, done.stderr
    assert "not reached" not in done.stdout
    assert td.Checkpointer(tmp_path).checkpoints() == [2, 1]  # the step after the signal was saved
