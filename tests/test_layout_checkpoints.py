"""Checkpoints move between any two layouts of one model, and torch's DCP tools read them.

A six-step SGD-with-momentum run is cut in three: each part restores the previous part's
checkpoint into another layout (tensor parallel 2 -> 1 -> 3, pipeline 2 -> 1 -> 2, dp x tp
2x2 -> 1x2 -> 1x1, fully_shard 2 -> plain -> 3), trains two steps and saves. The end must
equal six uninterrupted steps of one process (the bug this guards against: a tensor-parallel
checkpoint restored as rank 0's slices everywhere trained on as a different model, silently).
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import tandem as td
from tandem.checkpoint.durable import CheckpointError
from tandem.testing import run_distributed

PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise_gather"}
BATCH = 12


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 6))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 6, generator=generator)


def _reference(steps: int) -> dict[str, torch.Tensor]:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _build(kind: str, size: int):
    """(model, optimizer, data-parallel size, data-parallel rank) of `kind` on this world."""
    model = _net()
    dp, dp_rank = 1, 0
    if kind == "tp" and size > 1:
        td.parallelize(model, PLAN, group=td.mesh(dp=1, tp=size).tp_group)
    elif kind == "dp_tp" and size > 1:
        mesh = td.mesh(dp=size // 2, tp=2)
        td.parallelize(model, PLAN, group=mesh.tp_group)
        dp, dp_rank = mesh.dp, mesh.dp_rank
    elif kind == "pp" and size > 1:
        model = td.Pipeline(model, chunks=2, balance=[2, 3])
    elif kind == "shard" and size > 1:
        td.fully_shard(model[0])
        td.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dp > 1:
        optimizer = td.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            group=mesh.dp_group)
    return model, optimizer, dp, dp_rank


def _full(model) -> dict[str, torch.Tensor]:
    if isinstance(model, td.Pipeline):
        merged = {}
        for part in td.allgather_object({k: v.clone() for k, v in model.state_dict().items()}):
            merged.update(part)
        return merged
    return td.fsdp.full_state_dict(model)


def phase(kind: str, directory: str, first: int, last: int) -> float:
    """Restore (from `first` completed steps), train to `last`, save; the difference from one
    uninterrupted process after `last` steps."""
    model, optimizer, dp, dp_rank = _build(kind, td.size())
    checkpointer = td.Checkpointer(directory, keep=1)
    if first:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)  # the checkpoint, not the seed, must bring the values back
        assert checkpointer.restore(model=model, optimizer=optimizer) == first
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in range(first, last):
        x, y = _batch(step)
        optimizer.zero_grad()
        if isinstance(model, td.Pipeline):
            model.train_step(x, y, nn.functional.mse_loss)
        else:
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    checkpointer.save(last - 1, model=model, optimizer=optimizer)
    got, expected = _full(model), _reference(last)
    assert set(got) == set(expected), sorted(got)
    return max((got[k] - v).abs().max().item() for k, v in expected.items())


# (kind, world size) per third of the run
JOURNEYS = {
    "tp 2 -> 1 -> 3": [("tp", 2), ("tp", 1), ("tp", 3)],
    "pp 2 -> 1 -> 2": [("pp", 2), ("pp", 1), ("pp", 2)],
    "dp x tp 2x2 -> 1x2 -> plain": [("dp_tp", 4), ("dp_tp", 2), ("tp", 1)],
    "fully_shard 2 -> plain -> 3": [("shard", 2), ("shard", 1), ("shard", 3)],
    "tp 2 -> fully_shard 2 -> pp 2": [("tp", 2), ("shard", 2), ("pp", 2)],
}


# Every journey on both engines (MPI: the CPU default of `tandem run`).
CASES = [(journey, backend) for journey in JOURNEYS for backend in ("gloo", "mpi")]


@pytest.mark.parametrize("journey,backend", CASES)
@pytest.mark.timeout(300)
def test_a_run_moves_between_layouts_and_ends_as_one_process(tmp_path, journey, backend):
    directory = str(tmp_path / "ck")
    for third, (kind, size) in enumerate(JOURNEYS[journey]):
        differences = run_distributed(phase, world_size=size, backend=backend,
                                      args=(kind, directory, 2 * third, 2 * third + 2))
        assert max(differences) < 1e-6, (journey, third, kind, size, differences)


def save_with_torch(directory: str) -> None:
    """torch's own DCP, on Gloo: a plain model saved by every rank."""
    model = _net()
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory)


def load_into_tensor_parallel(directory: str) -> float:
    model, _, _, _ = _build("tp", td.size())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert td.checkpoint.load_sharded(directory, model=model) == {}  # no tandem record: torch wrote it
    return max((td.fsdp.full_state_dict(model)[k] - v).abs().max().item()
               for k, v in _net().state_dict().items())


def save_tensor_parallel(directory: str) -> None:
    model, optimizer, _, _ = _build("tp", td.size())
    td.checkpoint.save_sharded(directory, model=model, optimizer=optimizer)


@pytest.mark.timeout(120)
def test_torch_reads_tandem_checkpoints_and_tandem_reads_torchs(tmp_path):
    theirs = str(tmp_path / "torch")
    run_distributed(save_with_torch, world_size=2, args=(theirs,))
    assert run_distributed(load_into_tensor_parallel, world_size=2, args=(theirs,)) == [0.0, 0.0]
    ours = str(tmp_path / "tandem")
    run_distributed(save_tensor_parallel, world_size=2, args=(ours,))
    # one process, no process group: torch's loader and converter read the slices as one model
    plain = _net()
    state = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=ours)
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    dcp_to_torch_save(ours, str(tmp_path / "model.pt"))
    converted = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(converted[f"model.{k}"], v) for k, v in plain.state_dict().items())


def bad_restores(directory: str) -> dict[str, str]:
    model, optimizer, _, _ = _build("tp", td.size())
    td.checkpoint.save_sharded(directory, model=model, optimizer=optimizer)
    before = td.fsdp.full_state_dict(model)
    errors = {}

    def attempt(name, **objects):
        try:
            td.checkpoint.load_sharded(directory, **objects)
        except (CheckpointError, ValueError) as error:
            errors[name] = str(error)

    other = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 8))
    attempt("names", model=other)
    attempt("optimizer", model=model, optimizer=torch.optim.Adam(model.parameters()))
    errors["untouched"] = str(all(torch.equal(before[k], v)
                                   for k, v in td.fsdp.full_state_dict(model).items()))
    if td.rank() == 0:  # a piece written by rank 1 disappears, then a file is truncated
        os.rename(os.path.join(directory, "__1_0.distcp"), os.path.join(directory, "moved"))
    td.barrier()
    attempt("missing", model=model)
    if td.rank() == 0:
        os.rename(os.path.join(directory, "moved"), os.path.join(directory, "__1_0.distcp"))
        os.truncate(os.path.join(directory, "__0_0.distcp"), 100)
    td.barrier()
    attempt("truncated", model=model)
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.timeout(120)
def test_bad_restores_name_the_problem_on_every_rank_and_load_nothing(tmp_path, backend):
    for rank, errors in enumerate(run_distributed(bad_restores, world_size=2, backend=backend,
                                                  args=(str(tmp_path / "ck"),))):
        assert "missing from the checkpoint" not in errors["names"], errors
        assert "in the checkpoint but not in the model: 4.weight [6, 6], 4.bias [6]" in errors["names"]
        assert "different shapes: 2.weight: model [8, 12], saved [6, 12]" in errors["names"], errors
        assert "Nothing was loaded" in errors["names"], errors
        assert "saved from SGD (torch.optim.sgd.SGD) but is restored into Adam" in \
            errors["optimizer"], errors
        assert errors["untouched"] == "True", rank
        assert "__1_0.distcp is missing" in errors["missing"], errors
        assert "__0_0.distcp is truncated" in errors["truncated"], errors


def restore_at_tp(directory: str) -> str:
    try:
        _build("tp", td.size())
    except ValueError as error:
        return str(error)
    return "built"


def test_a_tp_size_that_cannot_hold_the_checkpoint_names_the_valid_sizes(tmp_path):
    errors = run_distributed(restore_at_tp, world_size=4, args=(str(tmp_path),))
    assert all("out_features = 6 is not divisible by tp = 4: choose tp in [1, 2, 3, 6]" in e
               for e in errors), errors


def async_round_trip(directory: str) -> float:
    """Async saves while training goes on; the restored model is the one of the last save."""
    model, optimizer, _, _ = _build("shard", td.size())
    checkpointer = td.Checkpointer(directory, every=2, keep=1, async_save=True)
    for step in range(4):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()  # steps on while the previous save is being written
        checkpointer.save(step, model=model, optimizer=optimizer)
    checkpointer.wait()
    fresh, fresh_optimizer, _, _ = _build("shard", td.size())
    assert td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_optimizer) == 4
    got, expected = td.fsdp.full_state_dict(fresh), _reference(4)
    return max((got[k] - v).abs().max().item() for k, v in expected.items())


@pytest.mark.timeout(120)
def test_async_saves_restore_the_state_of_their_step(tmp_path):
    assert max(run_distributed(async_round_trip, world_size=2, args=(str(tmp_path / "ck"),))) < 1e-6


_KILLED_DURING_ASYNC_WRITE = """
import os, signal, sys
import torch
import tandem as td

model = torch.nn.Linear(256, 256)
checkpointer = td.Checkpointer(sys.argv[1], async_save=True)
checkpointer.save(0, model=model)
checkpointer.wait()                      # step 1 is on disk
with torch.no_grad():
    model.weight.add_(1.0)
checkpointer.save(1, model=model)        # being written by the background thread ...
os.kill(os.getpid(), signal.SIGKILL)     # ... when the job dies
"""


def test_a_kill_during_an_async_write_leaves_the_previous_checkpoint(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run([sys.executable, "-c", _KILLED_DURING_ASYNC_WRITE, str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == -9, result.stderr
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    assert td.Checkpointer(tmp_path).restore(model=model) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step-00000001"]
