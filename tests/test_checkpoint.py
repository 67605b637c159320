"""Model and optimizer state across ranks: broadcast, replica check, atomic save and load.

One `run_distributed` call per area checks many cases; the crash test kills a real process
between the checkpoint's write and its rename.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tandem as td
from tandem.checkpoint.checkpointer import CheckpointError
from tandem.comm.agreement.agree import LayoutMismatchError
from tandem.diagnostics.replicas import ReplicaMismatchError
from tandem.testing import run_distributed


class _ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


def _model(seed: int) -> nn.Module:
    """float32 and float64 parameters, and buffers (one of them an integer): several messages."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), _ToDouble(),
                         nn.Linear(8, 3).double())


def _expect(error_type, call, *fragments):
    try:
        call()
    except error_type as error:
        missing = [f for f in fragments if f not in str(error)]
        assert not missing, f"{missing} not in: {error}"
        return str(error)
    raise AssertionError(f"{call} did not raise {error_type.__name__}")


# -- broadcast_parameters and check_replicas ------------------------------------------------


def check_broadcast_and_replicas():
    model = _model(seed=100 + td.rank())  # a different random init on every rank
    model[1].running_mean.fill_(float(td.rank()))
    # buffers="strict": the differing BatchNorm statistics are named beside the parameters.
    before = _expect(ReplicaMismatchError, lambda: td.check_replicas(model, buffers="strict"),
                     "0.weight", "rank 1", "1.running_mean")
    td.broadcast_parameters(model)
    td.check_replicas(model, buffers="strict")
    reference = _model(seed=100)
    reference[1].running_mean.fill_(0.0)
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(),
                                         strict=True):
        assert torch.equal(mine, theirs), f"{name} is not rank 0's"

    # A state dict works too (and from a root other than 0).
    state = {"w": torch.full((3,), float(td.rank())), "step": 5 + td.rank()}
    td.broadcast_parameters(state, root=1)
    assert state["w"].tolist() == [1.0] * 3 and state["step"] == 5 + td.rank()

    # Tolerances: a tiny difference on rank 1 passes atol, not the bitwise check.
    with torch.no_grad():
        if td.rank() == 1:
            model[0].bias[0] += 2.0**-20  # exact in float32 near the bias values
    td.check_replicas(model, atol=1e-5)
    message = _expect(ReplicaMismatchError, lambda: td.check_replicas(model),
                      "0.bias", "rank 1 by up to 9.54e-07")
    assert "0.weight" not in message

    # Different models: an error naming the rank and the first differing tensor, not a hang.
    other = nn.Linear(4, 8 + td.rank())
    _expect(LayoutMismatchError, lambda: td.broadcast_parameters(other), "rank 1", "weight (8, 4)", "(9, 4)")
    return before


@pytest.mark.timeout(120)
def test_broadcast_fixes_replicas_that_started_apart():
    messages = run_distributed(check_broadcast_and_replicas, world_size=2)
    assert messages[0] == messages[1]  # every rank raises the same error


# -- broadcast_optimizer_state --------------------------------------------------------------


def check_optimizer_state(kind):
    model = _model(seed=1)
    make = {
        "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-2),
        "adam": lambda params, lr: torch.optim.Adam(params, lr=lr, weight_decay=1e-2),
    }[kind]
    optimizer = make(model.parameters(), lr=0.1 if td.rank() == 0 else 0.5)
    if td.rank() == 0:  # only root has stepped: the others have no state at all
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).pow(2).sum().backward()
            optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    td.broadcast_optimizer_state(optimizer)
    # No parameter moved (Horovod's dummy step would have moved them under weight decay).
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    state = optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == 0.1
    assert len(state["state"]) == len(list(model.parameters()))
    # Same state everywhere, and the same update from the same gradients afterwards.
    td.broadcast_parameters(model)
    gathered = td.allgather_object(state)
    for key, value in gathered[0]["state"][0].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(gathered[1]["state"][0][key])), key
    optimizer.zero_grad()
    torch.manual_seed(3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    td.check_replicas(model)
    # Nobody has stepped: hyper-parameters still travel.
    fresh = make(model.parameters(), lr=1.0 + td.rank())
    td.broadcast_optimizer_state(fresh, root=1)
    assert fresh.param_groups[0]["lr"] == 2.0 and not fresh.state


@pytest.mark.timeout(120)
def test_broadcast_optimizer_state_to_ranks_that_have_not_stepped():
    for kind in ("sgd", "adam"):
        run_distributed(check_optimizer_state, world_size=2, args=(kind,))


# -- save and load ---------------------------------------------------------------------------


def check_save_and_load(directory):
    path = os.path.join(directory, "ckpt.pt")
    model = _model(seed=td.rank())
    td.save({"model": model.state_dict(), "rank": td.rank(), "note": "hello"}, path)
    loaded = td.load(path)
    assert loaded["rank"] == 0 and loaded["note"] == "hello"
    assert torch.equal(loaded["model"]["0.weight"], _model(seed=0).state_dict()["0.weight"])
    model.load_state_dict(loaded["model"])
    td.check_replicas(model)
    # Overwrite in place; nothing but the checkpoint is left in the directory.
    td.save({"rank": td.rank(), "version": 2}, path)
    assert td.load(path)["version"] == 2
    assert sorted(os.listdir(directory)) == ["ckpt.pt"]
    # Failures reach every rank, with the path.
    missing_dir = os.path.join(directory, "no", "such", "dir", "x.pt")
    _expect(CheckpointError, lambda: td.save({}, missing_dir), "rank 0 could not save", missing_dir)
    _expect(FileNotFoundError, lambda: td.load(os.path.join(directory, "absent.pt")), "absent.pt")
    corrupt = os.path.join(directory, "corrupt.pt")
    if td.rank() == 0:
        with open(path, "rb") as source, open(corrupt, "wb") as target:
            target.write(source.read()[:50])
    td.barrier()
    _expect(CheckpointError, lambda: td.load(corrupt), corrupt, "truncated or corrupt")
    td.barrier()
    return True


@pytest.mark.timeout(120)
def test_save_and_load_agree_on_every_rank(tmp_path):
    assert run_distributed(check_save_and_load, world_size=2, args=(str(tmp_path),)) == [True, True]


_CRASHING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import tandem as td
    import tandem.checkpoint.checkpointer as checkpoint

    path = sys.argv[1]
    td.save({"version": 1}, path)
    checkpoint._before_replace = lambda temporary: os.kill(os.getpid(), signal.SIGKILL)
    td.save({"version": 2, "payload": list(range(10000))}, path)
    print("not reached")
""")


@pytest.mark.timeout(120)
def test_crash_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, str(path)], env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "not reached" not in result.stdout
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.pt.tmp-")  # the killed write
    assert td.load(path) == {"version": 1}
    td.save({"version": 3}, path)  # a later save succeeds and removes the orphan
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert td.load(path) == {"version": 3}


def test_corrupt_file_names_the_path(tmp_path):
    path = tmp_path / "broken.pt"
    path.write_bytes(b"PK\x03\x04 definitely not a zip archive")
    with pytest.raises(CheckpointError, match="broken.pt.*truncated or corrupt"):
        td.load(path)
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        td.load(tmp_path / "nothing.pt")
