"""A `td.tensor.Branches` model takes any optimizer: each branch is a whole tensor on one rank.

Branches registered its parameters as tensor-parallel slices, so the first step of Adafactor,
Muon or a hand-written LAMB over them was refused ("would run another algorithm"), although
each rank steps whole one-process tensors there, as one process does. Branches' tensors are now
their own kind (`splits.BRANCH`: whole, held by one rank of the group): an optimizer that steps
each tensor on its own is exact (the optimizer matrix's "Branches" cells), one that couples
tensors (LBFGS) is refused with the alternative. What treats the group's ranks as replicas
(ZeroOptimizer, DistributedOptimizer, DistributedDataParallel over a group that holds other
branches) is refused naming the fix; over the replicas of each branch (mesh.dp_group) it is
exact (the matrix's "Branches x ..." cells). `td.clip_grad_norm_` clips by the whole model's
norm, whatever number of tensors each rank holds; torch's `clip_grad_norm_` does too when every
rank holds as many branch tensors (their norms are paired over the group) and is refused with
the fix when not: it computed a wrong norm on the rank with fewer tensors (0.949 for 0.972) while
the other waited for a partner until the watchdog ended the job.
"""

import pytest
import torch
from test_optimizer_matrix import OPTIMIZERS, Paths, Towers, _batch, _branches
from torch import nn

import tandem as td
from tandem.parallel.layout.owner import owner_of
from tandem.testing import run_distributed

MAX_NORM = 0.05  # small: every step clips


class Pair(nn.Module):
    """Two paths of one tensor each (of different shapes), as many on each of 2 ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.paths = Paths([nn.Linear(6, 4, bias=False), nn.Linear(6, 5, bias=False)])
        self.head = nn.Linear(9, 3, bias=False)

    def forward(self, x):
        return self.head(self.paths(x))


def _torch_clip(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _clipped(model, optimizer, clip, steps: int = 3) -> None:
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        clip(model, MAX_NORM)
        optimizer.step()


def check_branches_with_wrappers_and_clipping() -> dict:
    td.init()
    out = {}
    for name, wrap in {
            "ZeroOptimizer": lambda m: td.ZeroOptimizer(torch.optim.Adam(m.parameters())),
            "DistributedOptimizer": lambda m: td.DistributedOptimizer(
                torch.optim.Adam(m.parameters()), named_parameters=m.named_parameters()),
            "DistributedDataParallel": lambda m: td.DistributedDataParallel(m)}.items():
        try:
            wrap(_branches())
            out[name] = "accepted"
        except ValueError as refusal:
            out[name] = str(refusal)
    out["kinds"] = sorted(owner_of(_branches()).split_kinds())  # what checkpoints record
    # td.clip_grad_norm_ over 1 tensor on rank 0 and 3 on rank 1, torch's over 1 and 1
    for clip, build, one in (("td", _branches, Towers), ("torch", _pair, Pair)):
        for name in ("Adafactor", "Muon", "Lamb (hand-written)"):
            reference = one()
            _clipped(reference, OPTIMIZERS[name](reference.parameters()), _torch_clip)
            model = build()
            _clipped(model, OPTIMIZERS[name](model.parameters()),
                     td.clip_grad_norm_ if clip == "td" else _torch_clip)
            full = model.state_dict()  # the one-process state dict, gathered over the group
            out[f"{clip} clipped {name}"] = max((full[k] - v).abs().max().item()
                                                for k, v in reference.state_dict().items())
    model = _branches()
    try:
        _clipped(model, torch.optim.Adam(model.parameters()), _torch_clip, steps=1)
        out["torch clip, 1 and 3 tensors"] = "accepted"
    except ValueError as refusal:
        out["torch clip, 1 and 3 tensors"] = str(refusal)
    return out


def _pair() -> Pair:
    model = Pair()
    model.paths = td.tensor.Branches(list(model.paths.mine), join="cat")
    return model


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_branches_refuse_replica_wrappers_over_their_group_and_clip_by_the_whole_norm(backend):
    """Measured before: torch's clip of 1 and 3 branch tensors, 0.949 on rank 0 for one process's
    0.972, and rank 1 waiting in its third norm until the watchdog's 60 s."""
    for out in run_distributed(check_branches_with_wrappers_and_clipping, 2, backend):
        assert "td.ZeroOptimizer over ranks [0, 1] would treat 'group0.param0' as a replica" \
            in out["ZeroOptimizer"], out
        assert "td.tensor.Branches branch held whole by one rank" in out["ZeroOptimizer"], out
        assert "step the model with the plain torch optimizer" in out["ZeroOptimizer"], out
        assert "group=mesh.dp_group" in out["ZeroOptimizer"], out
        assert "would average different tensor-parallel slices (or branches) of " \
            "'paths.mine.0." in out["DistributedOptimizer"], out
        assert "would copy rank 0's td.tensor.Branches branch 'paths.mine.0." \
            in out["DistributedDataParallel"], out  # its first broadcast
        for name in ("DistributedOptimizer", "DistributedDataParallel"):
            assert "group=mesh.dp_group" in out[name], out
        assert out["kinds"] == ["branch"], out
        for name in ("Adafactor", "Muon", "Lamb (hand-written)"):
            for clip in ("td", "torch"):
                assert out[f"{clip} clipped {name}"] < 1e-6, (clip, name, out)
        refusal = out["torch clip, 1 and 3 tensors"]
        assert "hold different numbers of branch tensors" in refusal, refusal
        assert "td.clip_grad_norm_(model, max_norm)" in refusal, refusal
