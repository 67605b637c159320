"""Preemption on a real SLURM (scripts/slurm-local.sh): requeued by itself, resumed exactly (issue 44).

examples/slurm/preemptible.sbatch, unchanged but for its time limit, runs a training script
under srun on 2 tasks. Signalled mid-epoch the way `#SBATCH --signal=B:USR1@N` signals it (the
batch shell; `scancel --signal=USR1 --batch`), or reaching its walltime (a 1-minute job that
tandem stops TANDEM_PREEMPT_LEAD seconds before its end), the job saves, requeues itself
(`scontrol requeue` from rank 0), and the requeued run, the same script with the same
arguments, resumes from the newest checkpoint and ends with the one-process parameters.
Every wait polls `scontrol show job` or the job's log with a deadline.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_slurm import (
    FINAL,
    job_state,
    read_log,
    slurm,  # noqa: F401 - the fixture: a running one-node cluster, or a skip
    until_done,
)

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "preemptible.sbatch"
SCRIPT = ROOT / "tests" / "scripts" / "preemptible_steps.py"
JOB_S = 240  # for the whole job, its requeues included

pytestmark = pytest.mark.usefixtures("slurm")


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "SLURM_"))}
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _reference(tmp_path: Path, epochs: int) -> tuple[dict, float]:
    """The one-process parameters, and the seconds that process took (its start-up, mostly)."""
    out = tmp_path / "reference.pt"
    started = time.monotonic()
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "one"), str(out), "--step-s", "0",
                    "--epochs", str(epochs)], env=_env(), check=True, timeout=JOB_S,
                   capture_output=True)
    return torch.load(out), time.monotonic() - started


def _submit(sbatch: Path, log: Path, directory: Path, out: Path, *options: str, epochs: int,
            step_s: float, env: dict[str, str]) -> str:
    done = subprocess.run(["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={log}", *options,
                           str(sbatch), str(SCRIPT), str(directory), str(out), "--step-s",
                           str(step_s), "--epochs", str(epochs)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _until_line(job: str, log: Path, line: str) -> None:
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        if line in read_log(log).splitlines():
            return
        assert job_state(job).get("JobState") not in FINAL, \
            f"job {job} ended before {line!r}:\n{read_log(log)}"
        time.sleep(0.1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"no {line!r} from job {job} within {JOB_S} s:\n{read_log(log)}")


def _check_resumed(state: dict[str, str], text: str, out: Path, reference: dict) -> list[int]:
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, text)
    assert int(state["Restarts"]) >= 1, (state, text)
    assert "requeued (scontrol requeue)" in text, text
    starts = [int(n) for n in re.findall(r"^start (\d+)$", text, re.M)]
    assert len(starts) == int(state["Restarts"]) + 1 and starts[0] == 0, text
    assert all(later > earlier for earlier, later in zip(starts, starts[1:], strict=False)), text
    for name, expected in reference.items():
        torch.testing.assert_close(torch.load(out)[name], expected, rtol=0, atol=1e-6)
    return starts


@pytest.mark.timeout(420)
def test_a_batch_job_signalled_mid_epoch_requeues_itself_and_resumes_exactly(tmp_path):
    reference, _ = _reference(tmp_path, epochs=2)
    log, out = tmp_path / "job.out", tmp_path / "out.pt"
    job = _submit(SBATCH, log, tmp_path / "ckpt", out, "--time=5", epochs=2, step_s=0.25,
                  env=_env())
    _until_line(job, log, "step 3")  # mid-epoch (8 steps an epoch)
    # What `#SBATCH --signal=B:USR1@N` does: the batch shell hears it, and passes it on.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    state = until_done(job, log, within=JOB_S)
    text = read_log(log)
    starts = _check_resumed(state, text, out, reference)
    assert state["Restarts"] == "1" and starts[1] % 8, text  # once, and mid-epoch
    assert "(restart 1)" in text, text


@pytest.mark.timeout(660)
def test_a_batch_job_at_its_walltime_requeues_itself_and_resumes_exactly(tmp_path):
    """A 1-minute job (SLURM's shortest walltime) that trains for 36 s after its start-up:
    tandem reads the job's end (squeue's time left on this SLURM, SLURM_JOB_END_TIME on newer
    ones) and stops 25 s before it, on its own, so every run has 35 s for its start-up and some
    steps (2 runs on a quiet machine, more on a busy one, whose start-ups are long; the first
    cannot finish even with no start-up at all) and 25 s for a step of 0.5 s, the save and the
    requeue. Start-ups of up to about 30 s end within the bound. (A lead of 15 s and steps of
    1 s gave the first run 45 s and took 79 s on a quiet machine, for the same checks.)"""
    reference, _ = _reference(tmp_path, epochs=9)
    # The example without its --signal line (a 120 s lead cannot fit a 1-minute job): the stop
    # comes from the walltime alone.
    sbatch = tmp_path / "walltime.sbatch"
    sbatch.write_text("".join(line for line in SBATCH.read_text().splitlines(keepends=True)
                              if not line.startswith("#SBATCH --signal")))
    log, out = tmp_path / "job.out", tmp_path / "out.pt"
    job = _submit(sbatch, log, tmp_path / "ckpt", out, "--time=1", epochs=9, step_s=0.5,
                  env=_env(TANDEM_PREEMPT_LEAD="25"))
    state = until_done(job, log, within=560)
    text = read_log(log)
    _check_resumed(state, text, out, reference)
    assert "preempted (walltime)" in text, text
    killed = [line for line in text.splitlines() if ("CANCELLED" in line or "TIME LIMIT" in line)
              and "DUE TO JOB REQUEUE" not in line]
    assert not killed, text  # it stopped itself before the limit, never killed by it
