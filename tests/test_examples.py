"""The examples run, as a user would start them: `tandem run -np 2 examples/...`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem as td

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*arguments: str, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", *arguments],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.timeout(240)
def test_train_digits_reaches_95_percent_on_two_ranks(tmp_path):
    checkpoint = tmp_path / "digits.pt"
    output = _run(str(EXAMPLES / "train_digits.py"), "--checkpoint", str(checkpoint), timeout=220)
    accuracy = re.search(r"\[0\] final test accuracy: ([0-9.]+)", output)
    assert accuracy, output
    assert float(accuracy.group(1)) > 0.95, output
    assert "[0] epoch 10: train loss" in output and "[1] epoch" not in output  # rank 0 reports
    state = td.load(checkpoint)
    assert state["epoch"] == 10 and abs(state["test_accuracy"] - float(accuracy.group(1))) < 1e-4
    assert isinstance(state["model"]["0.weight"], torch.Tensor)


@pytest.mark.timeout(240)
def test_train_resnet9_two_steps_on_synthetic_data(tmp_path):
    checkpoint = tmp_path / "resnet9.pt"
    output = _run(str(EXAMPLES / "train_resnet9.py"), "--steps", "2", "--batch-size", "8",
                  "--checkpoint", str(checkpoint), timeout=220)
    assert "synthetic CIFAR-shaped data" in output, output
    assert re.search(r"\[0\] final test accuracy: [0-9.]+ after 2 steps", output), output
    assert td.load(checkpoint)["steps"] == 2
