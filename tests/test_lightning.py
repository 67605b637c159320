"""Lightning on tandem: `Trainer(strategy="tandem")` and `Fabric(strategy="tandem")`.

The training script on the harness's shared worlds of two ranks (Gloo and MPI) against the
same script in one process with Lightning alone on the full batch: parameters equal to 1e-5 in
float32 (with gradient clipping, accumulation, sync_dist logging, validation, TensorBoard and
checkpoints), on strategy="tandem" and "tandem_fsdp", and within bf16's rounding under
precision="bf16-mixed". Then the failures, each
fast and named: a rank that raises in validation_step, `devices` that disagree with the
launcher (plain mpiexec here), configure_model() that replaces the world, Lightning not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
JOB_TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs lightning: pip install 'tandem[lightning]'")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(command: list[str], cwd: Path = ROOT, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(**extra), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


def tandem_run(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "tandem", "run", *args], **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """One process, Lightning's own single-device strategy, the full batch."""
    out = tmp_path_factory.mktemp("reference") / "params.pt"
    done = _run([sys.executable, str(SCRIPTS / "lightning_train.py"), "reference", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out)


def train_on_this_rank(out: str) -> str:
    """lightning_train.py's `tandem` mode on this rank of a shared world (the script's runs are
    about Lightning on tandem, not about starting a job): what it printed."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("lightning_train", SCRIPTS / "lightning_train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script.run("tandem", out)
    return printed.getvalue()


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_trainer_and_fabric_at_two_ranks_equal_one_process(backend, reference, tmp_path):
    if backend == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI world needs mpi4py")
    out = tmp_path / "params.pt"
    printed = run_distributed(train_on_this_rank, 2, backend=backend, args=(str(out),),
                              timeout=2 * JOB_TIMEOUT_S - 30)
    for rank in (0, 1):
        assert f"rank {rank} of 2 on {backend} done" in printed[rank], printed[rank]
        # the checkpoint went through td.save/td.load and every rank read rank 0's
        assert f"rank {rank}: checkpoint step 4" in printed[rank], printed[rank]
        for strategy in ("tandem", "tandem_fsdp"):
            assert f"rank {rank}: {strategy} fabric checkpoint loaded" in printed[rank]
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*")), "no TensorBoard events"
    mine = torch.load(out)
    for run, same in (("trainer", "trainer"), ("fabric", "fabric"), ("trainer_fsdp", "trainer"),
                      ("fabric_fsdp", "fabric")):
        for name, value in reference[same].items():
            assert torch.allclose(mine[run][name], value, rtol=0, atol=1e-5), (run, name)
    # strategy="tandem_fsdp" really sharded: each rank held a part of the parameters
    assert "rank 0: fsdp holds 89 of 178 parameters" in printed[0], printed[0]
    # ... saved its shards (no gather) and resumed from them: the same shards and momenta
    assert "rank 1: fsdp resumed from its shards" in printed[1], printed[1]
    # bf16 autocast rounds differently on a half batch: equal to bf16's precision (2^-8)
    bf16 = torch.finfo(torch.bfloat16).eps
    for name, value in reference["trainer_bf16"].items():
        assert torch.allclose(mine["trainer_bf16"][name], value, rtol=0, atol=bf16), name
    assert any(not torch.equal(reference["trainer_bf16"][n], reference["trainer"][n])
               for n in reference["trainer"]), "precision='bf16-mixed' changed nothing"


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_rank_that_raises_in_validation_step_ends_the_job_naming_it(backend):
    """Lightning alone waits for the missing rank forever (30 minutes with torch's default).
    TANDEM_TIMEOUT is far beyond this test's deadline: the end comes from the failure itself."""
    if backend == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    done = tandem_run("-np", "2", "--backend", backend, str(SCRIPTS / "lightning_fail.py"),
                      "validation", TANDEM_TIMEOUT="3600")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "tandem run: job failed: rank 1" in done.stderr, done.stderr
    assert "rank 1 broke in validation_step" in done.stderr, done.stderr
    assert "finished" not in done.stdout


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_devices_that_disagree_with_the_launcher_are_refused_naming_both():
    """Started by plain mpiexec: TandemEnvironment reads MPI's numbering as td.init() does."""
    if not HAVE_MPI:
        pytest.skip("needs mpi4py and an mpiexec")
    from tandem.testing import mpiexec_command

    done = _run([*mpiexec_command(2), sys.executable, str(SCRIPTS / "lightning_fail.py"),
                 "devices"])
    assert done.returncode != 0, done.stdout + done.stderr
    assert re.search(r"Trainer/Fabric\(devices=3, num_nodes=1\) does not match the job the "
                     r"launcher \((mpich|openmpi)\) started, 2 rank\(s\) on 1 node\(s\), 2 per "
                     r"node: it asks for 3 rank\(s\) per node, the job has 2", done.stderr), \
        done.stderr
    assert "Pass devices='auto', num_nodes=1 (or devices=2), or start the job as `tandem run " \
           "-np 3`" in done.stderr


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_configure_model_that_replaces_the_world_is_refused():
    done = _run([sys.executable, str(SCRIPTS / "lightning_fail.py"), "configure_model"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("strategy 'tandem': tandem was shut down and joined again (now rank 0 of 1 on gloo) "
            "inside configure_model()") in done.stderr, done.stderr
    assert "leave td.init()/td.shutdown()" in done.stderr


HIDDEN = """
import sys
sys.modules["lightning"] = None  # as if not installed: `import lightning` raises ImportError
import tandem                    # fine without lightning: it registers nothing yet
import torch
try:
    import tandem.lightning
except ImportError as error:
    print(error)
"""


def test_without_lightning_the_error_names_the_extra():
    done = _run([sys.executable, "-c", HIDDEN])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip install 'tandem[lightning]'" in done.stdout, done.stdout
    assert "could not register" not in done.stderr, done.stderr



@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_the_lightning_digits_example_learns_on_two_ranks(tmp_path):
    """bf16-mixed, TensorBoard and ModelCheckpoint, as a user starts it. (A third checkpoint
    once found rank 0 alone on Lightning's CheckpointIO path: lightning_train.py saves five.)"""
    pytest.importorskip("sklearn")
    done = tandem_run("-np", "2", str(ROOT / "examples" / "lightning_digits.py"), "--epochs", "2",
                      "--log-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if "val accuracy" in line)
    assert line.startswith("[0] 2 rank(s), 2 epochs:"), line
    assert float(line.rsplit(" ", 1)[1]) >= 0.95, line
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert [c.name for c in checkpoints] == ["epoch=1-step=90.ckpt"], checkpoints
    assert list(tmp_path.rglob("events.out.tfevents.*"))
