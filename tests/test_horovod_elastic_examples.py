"""Horovod's own elastic examples under `tandem run --min-np 2 --max-np 3`, with a killed rank.

`tests/scripts/horovod_examples/` holds horovod/horovod's
`examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py` and `pytorch_mnist_elastic.py`
as upstream has them but for their import line (`import tandem.horovod as hvd`), and a stand-in
torchvision (not installed here; its `dying.py` kills worker 2 mid-job, so the examples are not
edited). The synthetic benchmark keeps each rank's own timings (`img_secs`) and BatchNorm
statistics of each rank's own data in its state: Horovod compares neither, and neither does
`hvd.elastic.TorchState` (its first `state.commit()` used to raise). tandem's own
`td.elastic.State` still compares them, and names buffers as buffers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "tests" / "scripts" / "horovod_examples"
JOB_S = 120  # one elastic job, start to end, on the shared machine


def _run(script: str, *args: str, die: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "HVD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES), str(ROOT / "src")])
    if die:
        env["HVD_EXAMPLE_DIE"] = die
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args, script], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=JOB_S)


def _job(script: str, example_args: list[str], die: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "HVD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES), str(ROOT / "src")])
    env["HVD_EXAMPLE_DIE"] = die
    return subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "3", "--min-np", "2", "--max-np", "3",
         str(EXAMPLES / script), *example_args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_S)


def test_horovods_synthetic_benchmark_elastic_loses_a_rank_and_finishes_on_2(tmp_path):
    """Worker 2 dies at its 5th forward (the 1st benchmark batch): the job goes on with 2."""
    done = _job("pytorch_synthetic_benchmark_elastic.py",
                ["--batch-size", "4", "--num-warmup-batches", "2", "--num-batches-per-iter", "2",
                 "--num-iters", "3", "--no-cuda"], die="2:5")
    assert done.returncode == 0, done.stderr
    assert "tandem run: elastic: world 3 -> 2 (round 1): rank 2 (worker 2) exit code 9" \
        in done.stderr
    assert "resumed from commit" in done.stdout + done.stderr
    assert "Total img/sec on 2 CPU(s)" in done.stdout


def test_horovods_mnist_elastic_loses_a_rank_and_finishes_on_2(tmp_path):
    """Worker 2 dies at its 70th training image (its 5th batch of 16, in epoch 2)."""
    done = _job("pytorch_mnist_elastic.py",
                ["--batch-size", "16", "--epochs", "2", "--no-cuda", "--data-dir", str(tmp_path)],
                die="2:70")
    assert done.returncode == 0, done.stderr
    assert "world 3 -> 2 (round 1): rank 2 (worker 2) exit code 9" in done.stderr
    assert "Train Epoch: 2" in done.stdout
    assert "Test set: Average loss:" in done.stdout


def test_td_elastic_state_names_batchnorm_buffers_not_parameters(tmp_path):
    done = _run(str(ROOT / "tests" / "scripts" / "elastic_buffers.py"), "-np", "2", "--min-np", "1")
    assert done.returncode != 0
    assert "StateMismatchError: td.elastic: ranks committed different states (rank 1: other " \
           "model buffers (1.running_mean, 1.running_var" in done.stderr
    assert "other model parameters" not in done.stderr
    assert "td.SyncBatchNorm" in done.stderr and "hvd.elastic.TorchState" in done.stderr
