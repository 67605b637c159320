"""Checkpoints that load on any world size: 2 ranks save, 1 and 3 ranks resume.

One 2-rank world trains 10 steps and saves through `td.Checkpointer` three ways (fully_shard
with Adam: a sharded directory; ZeroOptimizer and DistributedOptimizer: their full state);
worlds of 1 and 3 ranks restore each, train 10 more steps and must equal 20 uninterrupted
steps of one process. Then the bad inputs (another model, a missing shard) and a crash in
the middle of a sharded save.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tandem as td
from tandem.checkpoint.durable import CheckpointError
from tandem.testing import run_distributed

BATCH = 12
KINDS = ("fully_shard", "zero", "distributed")


def _mlp(hidden: int = 7) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def _build(kind: str, hidden: int = 7):
    model = _mlp(hidden)
    if kind == "fully_shard":
        td.fully_shard(model[0])
        td.fully_shard(model[2])
        td.fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    adam = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    if kind == "zero":
        return model, td.ZeroOptimizer(adam)
    return model, td.DistributedOptimizer(adam, named_parameters=model.named_parameters())


def _steps(model, optimizer, first: int, last: int, everything: bool = False) -> None:
    per_rank = BATCH // (1 if everything else td.size())
    mine = slice(0, BATCH) if everything else slice(td.rank() * per_rank, (td.rank() + 1) * per_rank)
    for step in range(first, last):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 3, generator=generator), torch.randn(BATCH, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return td.fsdp.full_state_dict(model) if any(True for _ in td.parallel.fully_shard.units(model)) \
        else model.state_dict()


def check_save(directory: str) -> list[str]:
    for kind in KINDS:
        model, optimizer = _build(kind)
        _steps(model, optimizer, 0, 10)
        td.Checkpointer(os.path.join(directory, kind)).save(9, model=model, optimizer=optimizer)
    return sorted(os.listdir(os.path.join(directory, "fully_shard", "step-00000010")))


def check_resume(directory: str) -> dict[str, float]:
    reference = _mlp()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01, eps=1e-3)
    _steps(reference, plain, 0, 20, everything=True)
    differences = {}
    for kind in KINDS:
        model, optimizer = _build(kind)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the checkpoint, not the seed, must bring the values back
        resumed_at = td.Checkpointer(os.path.join(directory, kind)).restore(model=model,
                                                                            optimizer=optimizer)
        assert resumed_at == 10, (kind, resumed_at)
        _steps(model, optimizer, 10, 20)
        got = _parameters(model)
        differences[kind] = max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return differences


def check_bad_inputs(directory: str) -> dict[str, str]:
    saved = os.path.join(directory, "fully_shard", "step-00000010")
    errors = {}
    other, other_optimizer = _build("fully_shard", hidden=6)
    try:
        td.checkpoint.load_sharded(saved, model=other, optimizer=other_optimizer)
    except CheckpointError as error:
        errors["model"] = str(error)
    plain = _mlp()
    td.checkpoint.load_sharded(saved, model=plain)  # a fully sharded checkpoint loads into the plain model
    model, optimizer = _build("fully_shard")
    td.checkpoint.load_sharded(saved, model=model)
    errors["unsharded"] = all(torch.equal(v, plain.state_dict()[k])
                              for k, v in td.fsdp.full_state_dict(model).items())
    before = td.fsdp.full_state_dict(model)
    broken = os.path.join(directory, f"broken-{td.size()}")
    if td.rank() == 0:
        shutil.copytree(saved, broken)
        os.unlink(os.path.join(broken, "__1_0.distcp"))
    td.barrier()
    try:
        td.checkpoint.load_sharded(broken, model=model, optimizer=optimizer)
    except CheckpointError as error:
        errors["missing"] = str(error)
    after = td.fsdp.full_state_dict(model)
    errors["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.timeout(300)
def test_resume_on_any_world_size(tmp_path, backend):
    files = run_distributed(check_save, world_size=2, backend=backend, args=(str(tmp_path),))[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # torch's DCP format
    for world_size in (1, 3):
        for rank, differences in enumerate(run_distributed(check_resume, world_size=world_size,
                                                           backend=backend,
                                                           args=(str(tmp_path),))):
            for kind, difference in differences.items():
                assert difference < 1e-5, (world_size, rank, kind, difference)
    for rank, errors in enumerate(run_distributed(check_bad_inputs, world_size=3, backend=backend,
                                                  args=(str(tmp_path),))):
        assert "2.weight: model [6, 5], saved [7, 5]" in errors["model"], (rank, errors["model"])
        assert "__1_0.distcp is missing" in errors["missing"], (rank, errors["missing"])
        assert errors["untouched"], rank
        assert errors["unsharded"], rank


_CRASHING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import tandem as td
    import tandem.checkpoint.dcp_files as sharded

    td.init()
    torch.manual_seed(0)
    model = td.fully_shard(torch.nn.Linear(3, 2))
    ckpt = td.Checkpointer(sys.argv[1])
    ckpt.save(0, model=model)
    sharded._before_publish = lambda temporary: os.kill(os.getpid(), signal.SIGKILL)
    with torch.no_grad():
        model._tandem_shard.add_(1.0)
    ckpt.save(1, model=model)
    print("not reached")
""")


def check_restore_after_crash(directory: str) -> bool:
    torch.manual_seed(0)
    model = td.fully_shard(nn.Linear(3, 2))
    expected = td.fsdp.full_state_dict(model)  # the values of the first save
    with torch.no_grad():
        model._tandem_shard.zero_()
    assert td.Checkpointer(directory).restore(model=model) == 1
    return all(torch.equal(v, expected[k]) for k, v in td.fsdp.full_state_dict(model).items())


@pytest.mark.timeout(120)
def test_crash_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == -signal.SIGKILL, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != ".tandem-owner")
    assert names[0].startswith(".step-00000002.tmp-") and names[1:] == ["step-00000001"], names
    assert run_distributed(check_restore_after_crash, world_size=1, args=(str(tmp_path),)) == [True]


@pytest.mark.timeout(240)
def test_tandem_run_max_restarts_resumes_a_fully_sharded_job(tmp_path):
    """Rank 1 is killed at step 7 of 12; the restart resumes from the sharded step-6 checkpoint
    and ends where one process training on both ranks' data for 12 steps ends."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(root, "src"), env.get("PYTHONPATH")]))
    out = tmp_path / "params.pt"
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo", "--max-restarts", "1",
         os.path.join(root, "tests", "scripts", "fault_train.py"), "kill", "--shard", "--steps", "12",
         "--at", "7", "--rank", "1", "--ckpt", str(tmp_path / "ck"), "--every", "3", "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr
    assert "[0] resumed at step 6" in result.stdout, result.stdout
    assert (tmp_path / "ck" / "step-00000012" / ".metadata").is_file()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(12):
        x = torch.cat([torch.randn(32, 8, generator=torch.Generator().manual_seed(1000 * step + r))
                       for r in range(2)])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
        optimizer.step()
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (torch.load(out) - expected).abs().max() < 1e-5
