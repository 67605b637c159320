"""Accelerate and the Hugging Face Trainer under `tandem run`, as under torchrun.

One script (tests/scripts/hf_train.py: an `Accelerator(cpu=True)` loop, then
`transformers.Trainer` on a tiny GPT-2 built from a config) runs under
`python -m torch.distributed.run --nproc-per-node 2` (the reference), unchanged under
`tandem run -np 2 --backend gloo` (torchrun's variables are enough), and under `tandem run -np 2`
on MPI with `td.init()` first, where both train on tandem's torch.distributed group. The
parameters after 4 steps must equal the torchrun run's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_train.py"
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
JOB_TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None,
    reason="needs accelerate and transformers: pip install 'tandem[hf]'")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TRANSFORMERS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"  # nothing to download, ever
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def torchrun_parameters(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("torchrun") / "params.pt"
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(SCRIPT), str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out)


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("launch", ["gloo", "mpi"])
def test_accelerate_and_the_trainer_train_under_tandem_run_as_under_torchrun(
        launch, torchrun_parameters, tmp_path):
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    out = tmp_path / "params.pt"
    if launch == "gloo":  # the script as it is: Accelerate makes its own Gloo group
        command = ["--backend", "gloo", str(SCRIPT), str(out)]
        group = "gloo"
    else:  # td.init() first: Accelerate and the Trainer find tandem's group (MPI) and use it
        command = [str(SCRIPT), str(out), "--td-init"]
        group = "tandem"
    done = _run([sys.executable, "-m", "tandem", "run", "-np", "2", "--require-join", *command])
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert (f"[{rank}] accelerate: process {rank} of 2, DistributedType.MULTI_CPU over "
                f"{group}") in done.stdout, done.stdout
        assert (f"[{rank}] trainer: process {rank} of 2, ParallelMode.DISTRIBUTED over "
                f"{group}") in done.stdout, done.stdout
    mine = torch.load(out)
    for run in ("accelerate", "trainer"):
        for name, value in torchrun_parameters[run].items():
            assert torch.allclose(mine[run][name], value, rtol=0, atol=1e-6), (run, name)
