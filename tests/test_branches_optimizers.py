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
norm, whatever number of tensors each rank holds.
"""

import pytest
import torch
from test_optimizer_matrix import OPTIMIZERS, Towers, _batch, _branches

import tandem as td
from tandem.parallel.layout.owner import owner_of
from tandem.testing import run_distributed

MAX_NORM = 0.05  # small: every step clips


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
    # td.clip_grad_norm_ over 1 tensor on rank 0 and 3 on rank 1, with a per-tensor optimizer
    for name in ("Adafactor", "Muon", "Lamb (hand-written)"):
        reference = Towers()
        _clipped(reference, OPTIMIZERS[name](reference.parameters()),
                 lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
        model = _branches()
        _clipped(model, OPTIMIZERS[name](model.parameters()), td.clip_grad_norm_)
        full = model.state_dict()  # the one-process state dict, gathered over the group
        out[f"clipped {name}"] = max((full[k] - v).abs().max().item()
                                     for k, v in reference.state_dict().items())
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_branches_refuse_replica_wrappers_over_their_group_and_clip_by_the_whole_norm(backend):
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
            assert out[f"clipped {name}"] < 1e-6, (name, out)
