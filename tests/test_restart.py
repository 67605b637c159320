"""`tandem run --max-restarts` and `td.Checkpointer`: a killed job resumes and ends identical.

The central check: a 2-rank data-parallel job killed at step 7 of 12 and restarted
(`--max-restarts 1`) ends with exactly the parameters of a run that was never interrupted,
and so does one whose rank 0 dies inside `td.save` between the write and the rename.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.checkpoint.durable import CheckpointError
from tandem.launch.local.supervisor import Failure, summary

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "fault_train.py")
STEPS = "12"


def tandem_run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- without processes ---------------------------------------------------------------------

def test_failures_read_the_same_on_every_node():
    killed = Failure(node=1, host="n2", rank=3, pid=77, returncode=-9, tail=("step 4",))
    assert killed.code == 137 and killed.restartable
    text = summary(killed, " (attempt 1 of 2)")
    assert text.splitlines()[0] == (
        "tandem run: job failed (attempt 1 of 2): rank 3 (pid 77, node 1 on n2) killed by "
        "SIGKILL (exit code 137); it was the first rank to fail.")
    assert text.splitlines()[-1] == "  [3] step 4"
    lost = Failure(node=1, host="n2", lost="no word from it for 5 s")
    assert lost.code == 1 and not lost.restartable
    assert "node 1 (n2) is unreachable: no word from it for 5 s" in summary(lost)
    assert Failure(node=0, host="n1", interrupt=2).code == 130


def test_checkpointer_saves_every_n_steps_keeps_the_newest_and_restores(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = td.Checkpointer(tmp_path / "ck", every=2, keep=2)
    assert ckpt.restore(model=model, optimizer=opt) == 0  # nothing yet
    written, saved, momentum = [], {}, []
    for step in range(7):
        model(torch.full((1, 3), float(step))).sum().backward()  # the momentum changes each step
        opt.step()
        written.append(ckpt.save(step, model=model, optimizer=opt))
        if written[-1]:
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    assert written == [False, True, False, True, False, True, False]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        ".tandem-owner", "step-00000004", "step-00000006"]  # DCP directories, and whose they are
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert td.Checkpointer(tmp_path / "ck", every=2).restore(model=fresh, optimizer=fresh_opt) == 6
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 saved.values(), strict=True))
    restored = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(restored, momentum, strict=True))
    assert fresh_opt.param_groups[0]["lr"] == 0.1 and fresh_opt.param_groups[0]["momentum"] == 0.9
    # an unreadable newest checkpoint is an error that names it, never skipped for an older one
    (tmp_path / "ck" / "step-00000008").mkdir()
    with pytest.raises(CheckpointError, match=r"step-00000008' has no \.metadata"):
        ckpt.restore(model=fresh)
    with pytest.raises(CheckpointError, match="neither skips nor overwrites it"):
        td.Checkpointer(tmp_path / "ck", every=2).save(9, model=fresh)  # a new run looks first
    with pytest.raises(CheckpointError, match="neither skips nor overwrites it"):
        ckpt.save(7, model=fresh)  # the same path again


def test_checkpointer_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="every=0"):
        td.Checkpointer(tmp_path, every=0)
    ckpt = td.Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="lr=float has no state_dict"):
        ckpt.save(0, lr=0.1)
    with pytest.raises(ValueError, match="nothing to save"):
        ckpt.save(0)
    ckpt.save(0, model=nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match=r"no state for 'optimizer'; it holds \['model'\]"):
        ckpt.restore(optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0))


# --- jobs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> torch.Tensor:
    out = tmp_path_factory.mktemp("reference") / "params.pt"
    # On Gloo, like the restarted jobs (restarts run on Gloo): one engine, bit for bit.
    result = tandem_run("-np", "2", "--backend", "gloo", TRAIN, "ok", "--steps", STEPS,
                        "--out", str(out))
    assert result.returncode == 0, result.stderr
    return torch.load(out)


@pytest.mark.timeout(240)
def test_a_killed_job_restarts_from_its_checkpoint_and_ends_identical(tmp_path, uninterrupted):
    out = tmp_path / "params.pt"
    result = tandem_run("-np", "2", "--max-restarts", "1", TRAIN, "kill", "--steps", STEPS,
                        "--at", "7", "--rank", "1", "--ckpt", str(tmp_path / "ck"),
                        "--every", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert "job failed (attempt 1 of 2): rank 1" in err and "SIGKILL" in err
    assert "restarting the whole job: attempt 2 of 2, TANDEM_RESTART=1" in err
    assert "the job succeeded after 1 restart(s)" in err
    assert "[0] resumed at step 6" in result.stdout  # the checkpoint after 6 completed steps
    assert "[0] pid=" in result.stdout and "attempt=1" in result.stdout
    assert torch.equal(torch.load(out), uninterrupted)


@pytest.mark.timeout(240)
def test_a_crash_inside_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "params.pt"
    ckpt = tmp_path / "ck"
    result = tandem_run("-np", "2", "--max-restarts", "1", TRAIN, "save_kill", "--steps", STEPS,
                        "--at", "4", "--rank", "0", "--ckpt", str(ckpt), "--every", "3",
                        "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "job failed (attempt 1 of 2): rank 0" in result.stderr
    # rank 0 died renaming the checkpoint of step 6: the one of step 3 was intact
    assert "[0] resumed at step 3" in result.stdout
    assert torch.equal(torch.load(out), uninterrupted)


@pytest.mark.timeout(120)
def test_restarts_stop_when_exhausted():
    result = tandem_run("-np", "2", "--max-restarts", "1",
                        str(ROOT / "tests" / "scripts" / "launch_fail.py"), "exit3")
    assert result.returncode == 3  # the failing rank's own code, from the last attempt
    assert "job failed (attempt 1 of 2): rank 1" in result.stderr
    assert "job failed (attempt 2 of 2): rank 1" in result.stderr
    assert result.stderr.count("restarting the whole job") == 1
