"""torch.compile over `td.fully_shard`, on real 2-rank worlds: the ways a user compiles it.

A unit's gather and free run in forward hooks, eagerly (as torch's FSDP2 runs its own): the
compute *between* hooks is what compiles. So a model is compiled per unit, as torchtitan does
with FSDP2:

    td.fully_shard(block); block.forward = torch.compile(block.forward)  # names unchanged
    model.blocks[i] = torch.compile(block); td.fully_shard(model.blocks[i])  # torchtitan's order

Each gives the eager run's parameters after 4 Adam steps (1e-5, fp32), with no graph break and
no recompilation (the gathered parameters are new tensors every step: they must be graph
inputs, never guards). `torch.compile(model)` over the whole model is correct too, and
compiles the same pieces between the hooks: never fewer graphs, never more breaks than torch's
FSDP2 on the same model (`torch._dynamo.explain`): a forward that calls the blocks one by one
breaks at each, for both.
"""

import pytest
import torch
from helpers import assert_compiled_like_eager
from torch import nn
from torch._dynamo.utils import counters

import tandem as td
from tandem.testing import run_distributed

STEPS = 4
TOLERANCE = 1e-5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Embedding-like input layer, a stack of blocks, a head: a transformer's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _shard(model: Net, compile_blocks: str | None) -> None:
    for i, block in enumerate(model.blocks):
        if compile_blocks == "before":  # torchtitan: compile, then shard the compiled block
            model.blocks[i] = block = torch.compile(block)
        td.fully_shard(block)
        if compile_blocks == "forward":
            block.forward = torch.compile(block.forward)
    td.fully_shard(model)


def _train(recipe: str, device: str = "cpu") -> tuple[dict, dict]:
    torch._dynamo.reset()
    counters.clear()
    model = Net().to(device)
    _shard(model, {"per block, forward": "forward", "per block, torchtitan": "before"}.get(recipe))
    run = torch.compile(model) if recipe == "whole model" else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    graphs_after = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)
        x, y = x.to(device), y.to(device)
        mine = slice(4 * td.rank(), 4 * td.rank() + 4)
        opt.zero_grad()
        nn.functional.mse_loss(run(x[mine]), y[mine]).backward()
        opt.step()
        graphs_after.append(counters["stats"]["unique_graphs"])
    # Compiled names carry `_orig_mod.` (torchtitan's order): compare by the model's own names.
    state = {k.replace("_orig_mod.", ""): v.clone() for k, v in td.fsdp.full_state_dict(model).items()}
    return state, {"breaks": sum(counters["graph_break"].values()),
                   "graphs": counters["stats"]["unique_graphs"],
                   "recompiled": graphs_after[-1] - graphs_after[1]}


def check_recipes(device: str = "cpu"):
    eager, _ = _train("eager", device)
    results = {}
    for recipe in ("per block, forward", "per block, torchtitan", "whole model"):
        state, graphs = _train(recipe, device)
        assert state.keys() == eager.keys(), sorted(set(state) ^ set(eager))
        results[recipe] = {"difference": max((state[k] - eager[k]).abs().max().item() for k in eager),
                           **graphs}
    return results


def assert_recipes(results_per_rank, tolerance: float = TOLERANCE) -> None:
    # Per block: one graph (the blocks share their code), nothing broken.
    assert_compiled_like_eager(results_per_rank, tolerance, dict.fromkeys(
        ("per block, forward", "per block, torchtitan"), (0, 1)))


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_compiled_fully_shard_matches_eager(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    assert_recipes(run_distributed(check_recipes, world_size=2, backend=backend, timeout=300))


class Unrolled(nn.Module):
    """Blocks called one by one, not in a loop: dynamo traces the forward and breaks at each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.first, self.second, self.out = nn.Linear(6, 8), Block(8), Block(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.second(self.first(self.inp(x))))


def _inner_units(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, Net):
        return list(model.blocks)
    if isinstance(model, Unrolled):
        return [model.first, model.second]
    return [model[0], model[2]]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def check_whole_model_against_fsdp2():
    """`torch._dynamo.explain` of the whole model, fully sharded by tandem and by FSDP2."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    results = {}
    for build in (Net, Unrolled, _mlp):
        for name, shard in (("tandem", td.fully_shard), ("FSDP2", fsdp2_fully_shard)):
            torch._dynamo.reset()
            model = build()
            for unit in _inner_units(model):
                shard(unit)
            shard(model)
            explained = torch._dynamo.explain(model)(torch.randn(4, 6))
            results[build.__name__, name] = (explained.graph_count,
                                             max(explained.graph_break_count, 0))
    return results


def test_whole_model_compiles_as_much_as_fsdp2():
    for rank, results in enumerate(run_distributed(check_whole_model_against_fsdp2, world_size=2,
                                                   timeout=300)):
        for model in ("Net", "Unrolled", "_mlp"):
            (graphs, breaks), (fsdp2_graphs, fsdp2_breaks) = (results[model, "tandem"],
                                                              results[model, "FSDP2"])
            assert graphs >= max(fsdp2_graphs, 1), (rank, model, results)
            if model != "_mlp":  # (FSDP2 compiles nothing of that nn.Sequential: no count)
                assert breaks <= fsdp2_breaks, (rank, model, results)
        assert results["Net", "tandem"][1] == 0, (rank, results)  # the loop runs eagerly
