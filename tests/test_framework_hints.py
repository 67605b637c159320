"""Frameworks that fall back to copies under `tandem run` are named at the job's end with the
line to add (`launch/local/joined.py`). Accelerate without `cpu=True` on a machine without GPUs
makes the process group and then runs each rank alone (DistributedType.NO): its ranks say so at
exit (`comm/torch_pg/copies.py`), and `--require-join` fails the job every time. A job no rank
joined names the frameworks its script imports (`framework_hints`: Lightning without a
strategy, Accelerate)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.launch import LaunchConfig
from tandem.launch.local.joined import framework_hints, script_of

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
JOB_TIMEOUT_S = 150

ACCELERATE = """import sys
from accelerate import Accelerator

accelerator = Accelerator(cpu=True) if "--cpu" in sys.argv else Accelerator()
print("distributed", accelerator.distributed_type, accelerator.num_processes)
"""


def tandem_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="Accelerate is in the `hf` extra")
@pytest.mark.parametrize("launch", ["gloo", "mpi"])
def test_accelerate_that_ran_copies_is_named_with_the_line_to_add(launch, tmp_path):
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    script = tmp_path / "run_me.py"
    script.write_text(ACCELERATE)
    done = tandem_run("-np", "2", "--backend", launch, "--require-join", str(script))
    assert "[0] distributed DistributedType.NO 1" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1, done.stderr
    assert f"tandem run: error: {script}: rank(s) 0, 1 of 2 joined torch.distributed, but " \
           "accelerate ran each as a copy of its own (DistributedType.NO)" in done.stderr
    assert "`Accelerator(cpu=True)`" in done.stderr
    if launch == "gloo":  # the line the hint names makes the job one: no hint, exit 0
        joined = tandem_run("-np", "2", "--require-join", str(script), "--cpu")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "[1] distributed DistributedType.MULTI_CPU 2" in joined.stdout
        assert "independent copies" not in joined.stderr


def test_the_hints_read_the_scripts_imports(tmp_path):
    fabric = tmp_path / "fabric.py"
    fabric.write_text("import torch\nfrom lightning.fabric import Fabric\nfabric = Fabric()\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n# from accelerate import Accelerator (a comment)\n"
                     "print('accelerate')\n")
    both = tmp_path / "both.py"
    both.write_text("if True:\n    import accelerate\n    import pytorch_lightning as pl\n")
    (hint,) = framework_hints(str(fabric))
    assert "Lightning" in hint and 'Fabric(..., strategy="tandem")' in hint
    assert framework_hints(str(plain)) == []
    assert [h.split(",")[0] for h in framework_hints(str(both))] == [
        "it imports Accelerate", "it imports Lightning"]
    assert framework_hints(str(tmp_path / "gone.py")) == []
    assert framework_hints(None) == []
    # which file a job runs: the script, the script after `python`, never a module
    assert script_of(LaunchConfig(np=2, program="t.py")) == "t.py"
    assert script_of(LaunchConfig(np=2, program="python3", args=("-u", "t.py", "x"),
                                  executable=True)) == "t.py"
    assert script_of(LaunchConfig(np=2, program="pkg.train", module=True)) is None
    assert script_of(LaunchConfig(np=2, program="python3", args=("-m", "pkg"),
                                  executable=True)) is None
