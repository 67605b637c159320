"""The examples run, as a user would start them: `tandem run -np 2 examples/...`."""

import csv
import math
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
    output = _run(str(EXAMPLES / "train_digits.py"), "--checkpoint", str(checkpoint),
                  "--log-dir", str(tmp_path / "logs"), timeout=220)
    accuracy = re.search(r"\[0\] final test accuracy: ([0-9.]+)", output)
    assert accuracy, output
    assert float(accuracy.group(1)) > 0.95, output
    assert "[0] epoch 10: train loss" in output and "[1] epoch" not in output  # rank 0 reports
    state = td.load(checkpoint)
    assert state["epoch"] == 10 and abs(state["test_accuracy"] - float(accuracy.group(1))) < 1e-4
    assert isinstance(state["model"]["0.weight"], torch.Tensor)
    assert re.search(r"\[0\] epoch 10: .* samples/s, step [0-9.]+ ms compute \+ [0-9.]+ ms comm", output)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:  # MetricLogger, on rank 0
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == [str(e) for e in range(1, 11)] + ["10"]
    assert float(rows[-2]["samples_per_s"]) > 0 and float(rows[-1]["test/accuracy"]) > 0.95


def _loss_on_a_fixed_batch(state: dict) -> float:
    """Cross-entropy of a ResNet-9 holding `state`, in training mode (batch statistics: the
    result depends on the parameters only, not on the running statistics)."""
    from tandem.bench.models import resnet9

    model = resnet9()
    model.load_state_dict(state)
    generator = torch.Generator().manual_seed(123)
    x, y = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,),
                                                                          generator=generator)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model.train()(x), y).item()


@pytest.mark.timeout(240)
def test_train_resnet9_two_steps_on_synthetic_data(tmp_path):
    checkpoint = tmp_path / "resnet9.pt"
    output = _run(str(EXAMPLES / "train_resnet9.py"), "--steps", "2", "--batch-size", "8",
                  "--checkpoint", str(checkpoint), timeout=220)
    assert "synthetic CIFAR-shaped data" in output, output
    assert re.search(r"\[0\] final test accuracy: [0-9.]+ after 2 steps", output), output
    trained = td.load(checkpoint)
    assert trained["steps"] == 2
    # The same script for zero steps, in one process, gives the model the two steps started
    # from (the same seed, and rank 0's initial parameters are broadcast to the others).
    start = tmp_path / "start.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    subprocess.run([sys.executable, str(EXAMPLES / "train_resnet9.py"), "--steps", "0",
                    "--batch-size", "8", "--checkpoint", str(start)],
                   check=True, capture_output=True, timeout=200, env=env)
    initial = td.load(start)
    assert initial["steps"] == 0
    from tandem.bench.models import resnet9

    names = [name for name, _ in resnet9().named_parameters()]
    unmoved = [n for n in names if torch.equal(trained["model"][n], initial["model"][n])]
    assert not unmoved, f"two optimizer steps left {unmoved} unchanged"
    before, after = _loss_on_a_fixed_batch(initial["model"]), _loss_on_a_fixed_batch(trained["model"])
    assert math.isfinite(before) and math.isfinite(after)
    assert abs(after - before) > 1e-4, (before, after)  # the loss moved
    momentum = trained["optimizer"]["state"]
    assert len(momentum) == len(names) and all(
        state["momentum_buffer"].abs().sum() > 0 for state in momentum.values())


@pytest.mark.timeout(180)
def test_tensor_parallel_example_learns_on_two_ranks():
    output = _run(str(EXAMPLES / "tensor_parallel.py"), "--steps", "21", timeout=150)
    last = [line for line in output.splitlines() if "loss" in line][-1]
    assert float(last.split("loss")[1]) < 0.1, output
    assert "tp=2 dp=1" in output
