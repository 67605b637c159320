"""Tensor parallelism under torch.compile: one graph, no break, the eager result, on 2 ranks.

The regions' collectives are torch custom operators while dynamo traces
(`parallel/tensor/region_ops.py`), so a compiled tensor-parallel model is one graph that
holds its all-reduces and all-gathers. Each model below trains 4 Adam steps eagerly and
compiled (default mode: dynamo + inductor) from the same start on the same data; the
parameters (gathered to one-process shapes) must agree to 1e-5, with no graph break
(`counters["graph_break"]`), one graph (`counters["stats"]["unique_graphs"]`) and no graph
compiled after the second step. The models cover every region: colwise + rowwise
(copy_to, reduce_from), split attention, a gathered head (gather_from) and a rowwise layer
that scatters a whole input (scatter_to), the last built by hand, outside `td.parallelize`.
A parallelized model called inside the compiled model breaks once, at its entry, where its
agreement runs (`NOT_ONE_GRAPH`).

With checks on, each forward of a compiled model still opens with the model's agreement (its
hooks run outside the graph): a rank that skips a forward, or a backward, is named.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_compiled_like_eager
from torch import nn
from torch._dynamo.utils import counters

import tandem as td
from tandem.testing import run_distributed

STEPS = 4
TOLERANCE = 1e-5
EMBED, HEADS, HIDDEN, SEQ, OUT = 8, 4, 16, 5, 6  # divisible by tp = 2


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(EMBED, HIDDEN), nn.Linear(HIDDEN, EMBED)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class Block(nn.Module):
    """Pre-norm block (split attention, split MLP), then a head gathered on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        # No projection biases: the key's bias has a zero gradient (softmax ignores a shift),
        # whose float noise Adam turns into full steps, compiled or not, split or not.
        self.attn = nn.MultiheadAttention(EMBED, HEADS, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(EMBED, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, EMBED))
        self.head = nn.Linear(EMBED, OUT)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=True,
                          attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


class HandBuilt(nn.Module):
    """Layers built by hand: a gathered column-parallel layer, then a row-parallel one that
    scatters its whole input (gather_from and scatter_to)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = td.tensor.ColumnParallelLinear(EMBED, HIDDEN, gather_output=True)
        self.down = td.tensor.RowParallelLinear(HIDDEN, EMBED, input_is_parallel=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp():
    return td.parallelize(Mlp(), {"up": "colwise", "down": "rowwise"})


def _block():
    return td.parallelize(Block(), {"attn": "attention", "mlp.0": "colwise",
                                    "mlp.2": "rowwise", "head": "colwise_gather"})


class Outer(nn.Module):
    """A parallelized model called inside the compiled one (its hooks are traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        return torch.relu(self.inner(x))


def _sequential():
    """torch's own container: dynamo would inline its call, hooks included
    (`compile_split.hooks_outside_graph`)."""
    return td.parallelize(nn.Sequential(nn.Linear(EMBED, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED)),
                          {"0": "colwise", "2": "rowwise"})


MODELS = {"colwise + rowwise": _mlp, "attention block": _block, "hand-built": HandBuilt,
          "nn.Sequential": _sequential, "inside a compiled model": Outer}
#: Breaks and graphs where they are not 0 and 1: a parallelized model called inside the
#: compiled one opens its forward with its agreement (a hook run eagerly: one break at its
#: entry, never one per collective); its forward is one graph, the caller's rest another.
NOT_ONE_GRAPH = {"inside a compiled model": (1, 2)}


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, SEQ, EMBED, generator=generator)


def _train(build, compiled: bool, device: str = "cpu") -> tuple[dict, list[int]]:
    """Parameters after STEPS Adam steps, and the graphs compiled so far after each step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build().to(device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    graphs = []
    for step in range(STEPS):
        opt.zero_grad()
        run(_batch(step).to(device)).square().mean().backward()
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return td.fsdp.full_state_dict(model), graphs


def check_compiled_matches_eager(device: str = "cpu") -> dict:
    results = {}
    for name, build in MODELS.items():
        eager, _ = _train(build, compiled=False, device=device)
        compiled, graphs = _train(build, compiled=True, device=device)
        assert eager.keys() == compiled.keys(), sorted(set(eager) ^ set(compiled))
        results[name] = {
            "difference": max((eager[k] - compiled[k]).abs().max().item() for k in eager),
            "breaks": sum(counters["graph_break"].values()), "graphs": graphs[-1],
            "recompiled": graphs[-1] - graphs[1], "reasons": list(counters["graph_break"])}
    return results


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_compiled_tensor_parallel_is_one_graph_and_matches_eager(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    assert_compiled(run_distributed(check_compiled_matches_eager, world_size=2, backend=backend,
                                    timeout=300))


def assert_compiled(results_per_rank, tolerance: float = TOLERANCE) -> None:
    assert_compiled_like_eager(results_per_rank, tolerance,
                               {name: NOT_ONE_GRAPH.get(name, (0, 1)) for name in MODELS})


def _train_on_a_mesh(compiled: bool) -> tuple[dict, dict]:
    """dp=2 x tp=2: the MLP split over this rank's tp group, its gradients averaged over the dp
    group by a DistributedOptimizer (whose bucket cut then splits the compiled graph too)."""
    torch._dynamo.reset()
    counters.clear()
    mesh = td.mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = td.parallelize(Mlp(), {"up": "colwise", "down": "rowwise"}, group=mesh.tp_group)
    run = torch.compile(model) if compiled else model
    opt = td.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), group=mesh.dp_group)
    for step in range(STEPS):
        opt.zero_grad()
        run(_batch(10 * step + mesh.dp_rank)).square().mean().backward()  # a batch per replica
        opt.step()
    return td.fsdp.full_state_dict(model), {"breaks": sum(counters["graph_break"].values()),
                                       "graphs": counters["stats"]["unique_graphs"]}


def check_mesh() -> dict:
    eager, _ = _train_on_a_mesh(compiled=False)
    compiled, graphs = _train_on_a_mesh(compiled=True)
    return {"difference": max((eager[k] - compiled[k]).abs().max().item() for k in eager), **graphs}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_compiled_tensor_parallel_on_a_dp_x_tp_mesh(backend):
    """The operators find their group by its ranks (a tp group of two, in a world of four)."""
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    for rank, result in enumerate(run_distributed(check_mesh, world_size=4, backend=backend,
                                                  timeout=300)):
        assert result["difference"] <= TOLERANCE, (rank, result)
        assert (result["breaks"], result["graphs"]) == (0, 1), (rank, result)


def _skip_one(what: str) -> tuple[int | None, str | None, str | None]:
    """Train a compiled model; rank 1 alone skips the forward (or only the backward) of step 2."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _mlp()
    run = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = -1
    try:
        for step in range(5):
            skipping = td.rank() == 1 and step == 2
            opt.zero_grad()
            if not (skipping and what == "forward"):
                loss = F.mse_loss(run(_batch(step)), torch.zeros(4, SEQ, EMBED))
                if not skipping:
                    loss.backward()
            opt.step()
    except td.CollectiveMismatchError as error:
        return step, type(error).__name__, str(error)
    return None, None, None


@pytest.mark.parametrize("what", ["forward", "backward"])
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_that_skips_a_compiled_step_is_named(backend, what):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    results = run_distributed(_skip_one, 2, backend, args=(what,), timeout=120)
    for step, kind, message in results:
        assert kind == "DivergedError", (step, kind, message)
        assert step in (2, 3), (step, message)
        if what == "forward":  # one forward fewer, as many optimizer steps
            assert "rank 0: tensor-parallel forward #3 of Mlp (after 2 optimizer steps)" in message
            assert "rank 1: tensor-parallel forward #3 of Mlp (after 3 optimizer steps)" in message
        else:
            assert "rank 0: tensor-parallel backward #3 of Mlp" in message, message
            assert "rank 1: tensor-parallel forward #4 of Mlp" in message, message
