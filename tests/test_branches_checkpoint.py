"""A `td.tensor.Branches` model's checkpoint: each branch under its one-process name, once.

Each rank keeps only its branches, as `mine.0`, `mine.1`, ... of its own `ModuleList`; before
Branches described its pieces, a checkpoint saw those as whole local tensors, so rank 0's
branch 0 and rank 1's branch 2 were both `branches.mine.0.*` and one overwrote the other. Now a
Branches answers the layout protocol (`local_pieces`: branch `first + j` whole, as
`mine.{first + j}.*`), so the checkpoint holds every branch once, torch's own loader reads it as
the one-process model, and it loads on another number of ranks (4 branches: 2 + 2 saved,
1 + 1 + 2 loaded) with the optimizer's momentum, training on as one process does. Like the other
split modules, `model.state_dict()` gathers the one-process state dict and `load_state_dict`
takes one, each rank keeping its branches.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import tandem as td
from tandem.testing import run_distributed

BRANCHES = 4


class Towers(nn.Module):
    """The one-process model: four paths over the same input, concatenated, then a head. Its
    names are those of `Joined` in a world of one (`branches.mine.i`)."""

    def __init__(self):
        super().__init__()
        self.branches = nn.Module()
        self.branches.mine = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 3), nn.Tanh()) for _ in range(BRANCHES))
        self.head = nn.Linear(3 * BRANCHES, 2)

    def forward(self, x):
        return self.head(torch.cat([path(x) for path in self.branches.mine], -1))


class Joined(nn.Module):
    """Towers with its paths spread over the ranks."""

    def __init__(self, towers: Towers):
        super().__init__()
        self.branches = td.tensor.Branches(list(towers.branches.mine), join="cat")
        self.head = towers.head

    def forward(self, x):
        return self.head(self.branches(x))


def _x() -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(7))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(_x()).square().sum().backward()
        opt.step()


def _reference(steps: int) -> Towers:
    torch.manual_seed(0)
    reference = Towers()
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), steps)
    return reference


def save_branches(directory: str) -> list[str]:
    torch.manual_seed(0)
    model = Joined(Towers())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, 2)
    td.checkpoint.save_sharded(directory, model=model, optimizer=opt)
    from tandem.parallel.layout.owner import owner_of

    # model.state_dict() speaks the one-process model too (gathered over the group)
    full, expected = model.state_dict(), _reference(2).state_dict()
    assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
    far = max((full[k] - v).abs().max().item() for k, v in expected.items())
    assert far < 1e-6, far
    return sorted(p.name for held in owner_of(model).held() for p in held.placements
                  if ".mine." in p.name)


def load_branches(directory: str) -> dict[str, float]:
    torch.manual_seed(5)  # other values everywhere: the load must bring every one
    model = Joined(Towers())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    td.checkpoint.load_sharded(directory, model=model, optimizer=opt)
    _train(model, opt, 1)  # the momentum came back too: one more step as one process
    reference = _reference(3)
    first = model.branches.first_branch
    out = {}
    for j, branch in enumerate(model.branches.mine):
        theirs = dict(reference.branches.mine[first + j].named_parameters())
        for name, p in branch.named_parameters():
            out[f"branch {first + j} {name}"] = (p - theirs[name]).abs().max().item()
    for name, p in model.head.named_parameters():
        out[f"head {name}"] = (p - dict(reference.head.named_parameters())[name]).abs().max().item()
    # and load_state_dict takes the one-process state dict, each rank keeping its branches
    torch.manual_seed(6)
    plain = Joined(Towers())
    plain.load_state_dict(reference.state_dict())
    for j, branch in enumerate(plain.branches.mine):
        theirs = dict(reference.branches.mine[first + j].named_parameters())
        for name, p in branch.named_parameters():
            out[f"loaded branch {first + j} {name}"] = (p - theirs[name]).abs().max().item()
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_branches_checkpoint_holds_each_branch_once_and_loads_on_another_world(backend, tmp_path):
    directory = str(tmp_path / "branches")
    held = run_distributed(save_branches, world_size=2, backend=backend, args=(directory,))
    # rank 0 holds branches 0 and 1, rank 1 branches 2 and 3, under the one-process names
    assert held[0] == sorted(f"branches.mine.{i}.0.{w}" for i in (0, 1) for w in ("bias", "weight"))
    assert held[1] == sorted(f"branches.mine.{i}.0.{w}" for i in (2, 3) for w in ("bias", "weight"))
    # torch's own loader, in one process, reads it as the one-process model
    plain = _reference(2)
    state = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=directory)
    far = {k: (state[k] - v).abs().max().item() for k, v in plain.state_dict().items()}
    assert max(far.values()) < 1e-6, far
    for differences in run_distributed(load_branches, world_size=3, backend=backend,
                                       args=(directory,)):
        assert differences and max(differences.values()) < 1e-6, differences
