"""The one resharding path (issue 40, item 2): state as boxes of one-process tensors.

A checkpoint and a change of world move state between layouts the same way
(`parallel/layout/state_pieces.py`): each rank lists the boxes it holds, the new layout lists the
boxes it needs, and each box needed is filled from the held boxes that meet it. Here: the box
arithmetic and a restore in one process (no processes; a 0-dim parameter included), then the
in-memory exchange td.elastic uses (`elastic/transfer.reshard`) from 2 ranks' ZeroOptimizer
state to 3 (flat shards and whole parameters), equal to the state the 2 ranks held, and what a
lost part leaves (named, nothing loaded), on Gloo and MPI in the shared 3-rank world.
"""

import pytest
import torch

import tandem as td
from tandem.elastic import transfer
from tandem.parallel.layout import state_pieces
from tandem.testing import run_distributed


def test_boxes_meet_in_the_box_they_share():
    assert state_pieces.overlap(((0, 2), (3, 4)), ((2, 0), (4, 3))) == ((2, 2), (1, 1))
    assert state_pieces.overlap(((0,), (3,)), ((3,), (2,))) is None  # touching, not meeting
    assert state_pieces.overlap(((), ()), ((), ())) == ((), ())  # a 0-dim tensor's one box
    full = torch.arange(24.0).view(4, 6)
    held = full[1:3, 2:6]  # the box ((1, 2), (2, 4)) of it
    assert torch.equal(state_pieces.region(held, (1, 2), ((2, 3), (1, 2))), full[2:3, 3:5])


def test_holes_are_the_elements_no_box_covers():
    covered = {"model.w": ((4, 6), [((0, 0), (2, 6)), ((3, 0), (1, 6)), ((0, 0), (2, 6))]),
               "model.b": ((6,), [((0,), (6,))]),
               "model.scale": ((), []), "model.bias": ((), [((), ())])}
    assert state_pieces.holes(covered) == {"model.w": [(12, 18)], "model.scale": [(0, 1)]}


class _Scaled(torch.nn.Module):
    """A linear layer and a 0-dim parameter (its state is per element too, its step is not)."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(features, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.fc(x) * self.scale


def _trained(optimizer_class):
    torch.manual_seed(0)
    model = _Scaled()
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.Adafactor])
def test_a_snapshot_restores_model_and_optimizer_state_in_place(optimizer_class):
    model, optimizer = _trained(optimizer_class)
    objects = {"model": model, "optimizer": optimizer}
    part = state_pieces.take(objects)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()
    with torch.no_grad():  # the live state moves on; the snapshot does not
        for p in model.parameters():
            p.add_(1.0)
    optimizer.state.clear()
    optimizer.param_groups[0]["lr"] = 9.0
    state_pieces.fill_from([part], objects)
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)
    restored = optimizer.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    torch.testing.assert_close(restored["state"], saved["state"], rtol=0, atol=0)
    assert restored["state"][2]["step"].dim() == 0  # the 0-dim parameter's step stays a step


def _net() -> torch.nn.Module:
    torch.manual_seed(0)  # sizes that cut unevenly over 2 and 3 ranks, and a 0-dim parameter
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
                               _Scaled(3))


def reshard_zero_2_to_3(name: str, lose_rank_1: bool) -> tuple:
    """ZeroOptimizer state of 2 steps on ranks 0 and 1, filled into a ZeroOptimizer over all 3
    ranks from the boxes the 2 held (rank 1's left out when it is 'lost')."""
    make = {"Adam": lambda p: torch.optim.Adam(p, lr=0.01),
            "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01)}[name]
    model = _net()
    old_group = td.new_group([0, 1])
    parts, expected = [], None
    if td.rank() < 2:
        old = td.ZeroOptimizer(make(model.parameters()), group=old_group)
        for step in range(2):
            x = torch.randn(6, 5, generator=torch.Generator().manual_seed(10 * step + td.rank()))
            old.zero_grad()
            model(x).square().mean().backward()
            old.step()
        expected = old.state_dict()  # the one-process state dict (collective over the 2)
        if not (lose_rank_1 and td.rank() == 1):
            parts = [state_pieces.take({"optimizer": old}, [model])]
    td.broadcast_parameters(model, root=0)
    expected = td.broadcast_object(expected, root=0)
    new = td.ZeroOptimizer(make(model.parameters()))
    holes = transfer.reshard(parts, {"optimizer": new}, [model])
    got = new.state_dict()
    try:
        torch.testing.assert_close(got["state"], expected["state"], rtol=0, atol=0)
        differs = None
    except AssertionError as error:
        differs = str(error)
    return (holes, got["param_groups"] == expected["param_groups"], differs,
            len(new.optimizer.state), len(got["state"]))


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("name", ["Adam", "Adafactor"])
def test_zero_state_of_2_ranks_is_resharded_in_memory_for_3(backend, name):
    """Adam: flat shards cut again; Adafactor: whole parameters owned anew (its factored
    second moments are not per element and travel whole)."""
    for holes, same_groups, differs, _, _ in run_distributed(
            reshard_zero_2_to_3, world_size=3, backend=backend, args=(name, False)):
        assert holes == {}
        assert same_groups and differs is None, differs


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_part_no_rank_holds_is_named_and_nothing_is_loaded(backend):
    for holes, _, _, held, entries in run_distributed(reshard_zero_2_to_3, world_size=3,
                                                      backend=backend, args=("Adam", True)):
        assert holes and all(name.startswith("optimizer.") for name in holes), holes
        assert all(b > a for spans in holes.values() for a, b in spans), holes
        assert held == 0 and entries == 0  # nothing was loaded
