"""torch.compile and activation checkpointing with tandem's wrappers, on real 2-rank worlds.

One world per engine (Gloo, MPI) runs every wrapper twice, eagerly and under
`torch.compile` (default mode: dynamo + inductor), on the same data from the same start; the
parameters after 4 Adam steps must agree to 1e-5. The compiled runs also count dynamo's graph
breaks and graphs: DistributedOptimizer, DistributedDataParallel and Pipeline stages compile
to one graph with no break and no recompilation. Under both data-parallel wrappers the graph
is cut at the gradient buckets, so a bucket is reduced while the backward of the layers before
it still runs: checked by structure (the compiled backward is one autograd node per bucket),
never by timing. fully_shard and parallelize train correctly compiled over the whole model
(tests/test_compile_fully_shard.py and tests/test_compile_tensor_parallel.py count their
graphs and breaks); no wrapper recompiles after its second step (tandem state that changes per step must
never become a dynamo guard).

Activation checkpointing (`td.checkpoint_wrapper`) is checked against one process: each rank
also trains a plain copy on the global batch.
"""

import copy
import gc

import pytest
import torch
from helpers import assert_compiled_like_eager
from torch import nn
from torch._dynamo.utils import counters

import tandem as td
from tandem.parallel.activation_checkpoint import is_checkpointed
from tandem.parallel.data_parallel.compile_split import BucketCaps
from tandem.parallel.fully_shard import units
from tandem.testing import run_distributed

STEPS = 4
BATCH = 8
TOLERANCE = 1e-5


class Block(nn.Module):
    """A residual MLP block that counts its forwards (a checkpointed one runs twice a step)."""

    def __init__(self, width: int, counting: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.counting, self.calls = counting, 0

    def forward(self, x):
        if self.counting:  # not when compiled: a side effect inside a checkpoint breaks the graph
            self.calls += 1
        return x + self.body(x)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _blocks(counting: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Block(8, counting), Block(8, counting), nn.Linear(8, 2))


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 2, generator=generator)


def _mine(tensor: torch.Tensor) -> torch.Tensor:
    rows = BATCH // td.size()
    return tensor[td.rank() * rows : (td.rank() + 1) * rows]


def _loss(output, target):
    return nn.functional.mse_loss(output, target)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> dict:
    return {"breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def _difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].cpu() - b[k].cpu()).abs().max().item() for k in a)


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


# -- one wrapper, eager or compiled ------------------------------------------------------------


_graphs_after_step: list[int] = []  # graphs compiled so far, after each step of the last run


def _train(model, step_fn, optimizer) -> None:
    _graphs_after_step.clear()
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        step_fn(x, y)
        optimizer.step()
        _graphs_after_step.append(counters["stats"]["unique_graphs"])


def _distributed_optimizer(compiled: bool):
    model = _mlp()
    run = torch.compile(model) if compiled else model
    opt = td.DistributedOptimizer(_adam(model.parameters()), named_parameters=model.named_parameters())
    _train(model, lambda x, y: _loss(run(_mine(x)), _mine(y)).backward(), opt)
    return _copy(model.state_dict())


def _wide() -> nn.Sequential:
    """Three Linear(512, 512): 1 MiB each, a bucket each with bucket_mb=1."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(512, 512), nn.Tanh())])


def _with_buffers() -> nn.Sequential:
    """BatchNorm: DDP broadcasts its buffers before each training forward (outside the graph)."""
    torch.manual_seed(0)
    # No bias before the norm: its gradient is float noise, which Adam turns into full steps.
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _ddp(compiled: bool):
    model = _with_buffers()
    wrapped = td.DistributedDataParallel(model, bucket_mb=1)
    run = torch.compile(wrapped) if compiled else wrapped
    _train(model, lambda x, y: _loss(run(_mine(x)), _mine(y)).backward(), _adam(model.parameters()))
    return _copy(model.state_dict())


def _fully_shard(compiled: bool):
    model = _mlp()
    td.fully_shard(model[0])
    td.fully_shard(model[2])
    td.fully_shard(model)
    run = torch.compile(model) if compiled else model
    _train(model, lambda x, y: _loss(run(_mine(x)), _mine(y)).backward(), _adam(model.parameters()))
    return td.fsdp.full_state_dict(model)


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _parallelize(compiled: bool):
    model = td.parallelize(_TwoLayer(), {"up": "colwise", "down": "rowwise"})
    run = torch.compile(model) if compiled else model
    _train(model, lambda x, y: _loss(run(x), y).backward(), _adam(model.parameters()))
    return td.fsdp.full_state_dict(model)


def _pipeline(compiled: bool, checkpointed: bool = False):
    pipe = td.Pipeline(_mlp(), chunks=2)
    if checkpointed:
        td.memory.checkpoint_wrapper(pipe.stage, policy=nn.Linear)
    if compiled:
        pipe.compile()
    _train(pipe, lambda x, y: pipe.train_step(x, y, _loss), _adam(pipe.parameters()))
    return pipe.state_dict()


WRAPPERS = {"DistributedOptimizer": _distributed_optimizer, "DistributedDataParallel": _ddp,
            "fully_shard": _fully_shard, "parallelize": _parallelize, "Pipeline": _pipeline}


def check_compiled():
    """Per wrapper: (max difference compiled vs eager, graph breaks, graphs compiled)."""
    results = {}
    for name, train in WRAPPERS.items():
        _fresh()
        eager = train(False)
        _fresh()
        compiled = train(True)
        # Graphs compiled after the second step: recompilations (tandem state in a guard).
        recompiled = _graphs_after_step[-1] - _graphs_after_step[1]
        results[name] = {"difference": _difference(eager, compiled), "recompiled": recompiled,
                         **_graphs()}
    return results


def _compiled_backward_nodes(loss: torch.Tensor) -> int:
    """How many compiled backward functions autograd will run for `loss` (one per piece)."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "CompiledFunction" in type(node).__name__
        stack.extend(child for child, _ in node.next_functions)
    return count


def check_pieces_under_compile(device: str = "cpu"):
    """The compiled backward's nodes: one per bucket under the DDP wrapper and under
    DistributedOptimizer (each piece's gradients are handed to the reducer before the next
    piece's backward runs); one in all once the optimizer is gone (its cut stands only while
    it lives). Three Linear(512, 512): a 1 MiB bucket each (bucket_mb=1)."""
    x = torch.randn(4, 512, device=device)
    pieces = {}
    _fresh()
    model = _wide().to(device)
    wrapped = td.DistributedDataParallel(model, bucket_mb=1)
    run = torch.compile(wrapped)
    for _ in range(2):  # the second forward runs the compiled code, the first compiles it
        loss = run(x).square().mean()
        pieces["DistributedDataParallel"] = (_compiled_backward_nodes(loss),
                                             len(wrapped._reducer.buckets))
        loss.backward()
    _fresh()
    model = _wide().to(device)
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), bucket_mb=1)
    run = torch.compile(model)
    for _ in range(2):
        loss = run(x).square().mean()
        pieces["DistributedOptimizer"] = (_compiled_backward_nodes(loss), len(opt._reducer.buckets))
        loss.backward()
        opt.step()
    graphs = _graphs()
    del opt, run, loss
    gc.collect()  # (the gradient hooks on the parameters hold the optimizer in a cycle)
    _fresh()
    model = _wide().to(device)
    loss = torch.compile(model)(x).square().mean()
    pieces["no optimizer"] = (_compiled_backward_nodes(loss), 0)
    return {"pieces": pieces, **graphs}


def check_compiled_twice():
    """torch.compile outside a DDP wrapper around a compiled model: one graph, no break."""
    _fresh()
    model = _with_buffers()
    wrapped = torch.compile(td.DistributedDataParallel(torch.compile(model)))
    _train(model, lambda x, y: _loss(wrapped(_mine(x)), _mine(y)).backward(), _adam(model.parameters()))
    twice = _graphs()
    once = _ddp(False)
    return {"difference": _difference(once, _copy(model.state_dict())), **twice}


def _assert_compiled(results_per_rank):
    # One graph for the model (a stage), no break and no recompilation (a counter that changes
    # every step would recompile every step, then fall back to eager).
    assert_compiled_like_eager(results_per_rank, TOLERANCE, dict.fromkeys(
        ("DistributedOptimizer", "DistributedDataParallel", "Pipeline"), (0, 1)))


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_compiled_wrappers_match_eager(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    _assert_compiled(run_distributed(check_compiled, world_size=2, backend=backend, timeout=300))


def test_compiled_backward_is_one_node_per_bucket():
    for rank, result in enumerate(run_distributed(check_pieces_under_compile, world_size=2,
                                                  timeout=300)):
        assert result["breaks"] == 0, (rank, result)
        for wrapper in ("DistributedDataParallel", "DistributedOptimizer"):
            assert result["pieces"][wrapper] == (3, 3), (rank, wrapper, result)
        # Without a cut, one node: every gradient is ready at the end of backward.
        assert result["pieces"]["no optimizer"] == (1, 0), (rank, result)


def test_compiling_twice_is_one_graph():
    for rank, result in enumerate(run_distributed(check_compiled_twice, world_size=2, timeout=300)):
        assert result["difference"] <= TOLERANCE, (rank, result)
        assert result["breaks"] == 0 and result["graphs"] == 1, (rank, result)


# -- activation checkpointing against one process ------------------------------------------------


def _reference_blocks():
    """The one-process run on the global batch."""
    model = _blocks()
    _train(model, lambda x, y: _loss(model(x), y).backward(), _adam(model.parameters()))
    return _copy(model.state_dict())


def check_checkpointing():
    reference = _reference_blocks()
    results = {}

    # DistributedOptimizer, eager and compiled.
    for compiled in (False, True):
        _fresh()
        model = td.memory.checkpoint_wrapper(_blocks(counting=not compiled), policy=Block)
        run = torch.compile(model) if compiled else model
        opt = td.DistributedOptimizer(_adam(model.parameters()), named_parameters=model.named_parameters())
        _train(model, lambda x, y, run=run: _loss(run(_mine(x)), _mine(y)).backward(), opt)
        key = "DistributedOptimizer compiled" if compiled else "DistributedOptimizer"
        results[key] = {"difference": _difference(reference, _copy(model.state_dict())),
                        "forwards per step": model[1].calls / STEPS, **_graphs()}
    # A graph under compile ends in the checkpoint's own recomputation, not a forward call.
    results["DistributedOptimizer compiled"].pop("forwards per step")

    # fully_shard: the blocks' gathers are made again for the recomputation, then freed; the
    # order of checkpoint_wrapper and fully_shard does not matter.
    for checkpoint_first in (True, False):
        model = _blocks()
        if checkpoint_first:
            td.memory.checkpoint_wrapper(model, policy=Block)
        for block in (model[1], model[2]):
            td.fully_shard(block)
        td.fully_shard(model)
        if not checkpoint_first:
            td.memory.checkpoint_wrapper(model, policy=Block)
        opt = _adam(model.parameters())
        _train(model, lambda x, y, model=model: _loss(model(_mine(x)), _mine(y)).backward(), opt)
        freed = [unit.freed() for name, unit in units(model) if name in ("1", "2")]
        key = "fully_shard" if checkpoint_first else "fully_shard, then checkpoint_wrapper"
        results[key] = {"difference": _difference(reference, td.fsdp.full_state_dict(model)),
                        "forwards per step": model[1].calls / STEPS, "freed": freed}

    # Pipeline: each rank checkpoints the blocks of its stage.
    pipe = td.Pipeline(_blocks(), chunks=2)
    td.memory.checkpoint_wrapper(pipe.stage, policy=Block)
    block = next(m for m in pipe.stage if isinstance(m, Block))
    _train(pipe, lambda x, y: pipe.train_step(x, y, _loss), _adam(pipe.parameters()))
    results["Pipeline"] = {"difference": _difference(reference, pipe.state_dict()),
                           "forwards per step": block.calls / STEPS}

    # td.parallelize: the recomputation repeats the slices' collectives, on every rank alike;
    # each rank's gradients are its slices of the one-process ones.
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sliced = copy.deepcopy(whole)
    td.parallelize(sliced, {"0": "colwise", "2": "rowwise"})
    td.memory.checkpoint_wrapper(sliced)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    whole(x).square().sum().backward()
    sliced(x).square().sum().backward()
    r, g = td.rank(), dict(sliced.named_parameters())
    expected = {"0.weight": whole[0].weight.grad[4 * r:4 * r + 4],
                "0.bias": whole[0].bias.grad[4 * r:4 * r + 4],
                "2.weight": whole[2].weight.grad[:, 4 * r:4 * r + 4], "2.bias": whole[2].bias.grad}
    results["parallelize"] = {"difference": max(
        (g[name].grad - grad).abs().max().item() for name, grad in expected.items())}
    return results


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_checkpointing_matches_one_process(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    for rank, results in enumerate(run_distributed(check_checkpointing, world_size=2,
                                                   backend=backend, timeout=300)):
        for name, result in results.items():
            assert result["difference"] <= TOLERANCE, (rank, name, result)
        # Forward, then the recomputation in backward (2 micro-batches each on the pipeline).
        assert results["DistributedOptimizer"]["forwards per step"] == 2, (rank, results)
        for key in ("fully_shard", "fully_shard, then checkpoint_wrapper"):
            assert results[key]["forwards per step"] == 2, (rank, key, results[key])
            assert results[key]["freed"] == [True, True], (rank, key, results[key])
        assert results["Pipeline"]["forwards per step"] == 4, (rank, results)
        assert results["DistributedOptimizer compiled"]["breaks"] == 0, (rank, results)


# -- without processes ---------------------------------------------------------------------------


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x).square().mean()
    loss.backward()
    return sum(storages.values())


def test_checkpoint_wrapper_keeps_names_and_saves_less():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(64) for _ in range(4)])
    reference = copy.deepcopy(model)
    x = torch.randn(32, 64)
    plain = _saved_bytes(reference, x)
    assert td.memory.checkpoint_wrapper(model, policy=Block) is model
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [is_checkpointed(m) for m in model] == [True] * 4
    assert not is_checkpointed(model) and not is_checkpointed(model[0].body)
    checkpointed = _saved_bytes(model, x)
    assert checkpointed < plain / 2, (checkpointed, plain)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # A copy recomputes its own forward, not the original's.
    twin = copy.deepcopy(model)
    assert twin[0].forward.forward.__self__ is twin[0]


def test_checkpoint_wrapper_bad_inputs():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(TypeError, match="takes an nn.Module"):
        td.memory.checkpoint_wrapper(lambda x: x)
    with pytest.raises(TypeError, match="policy must be a module class"):
        td.memory.checkpoint_wrapper(model, policy="Linear")
    with pytest.raises(ValueError, match="picked no module of Sequential"):
        td.memory.checkpoint_wrapper(model, policy=nn.Conv2d)
    td.memory.checkpoint_wrapper(model, policy=lambda m: isinstance(m, nn.Linear))
    with pytest.raises(ValueError, match="0 is already checkpointed"):
        td.memory.checkpoint_wrapper(model, policy=nn.Linear)


def check_compile_pipeline_twice():
    pipe = td.Pipeline(_mlp(), chunks=2).compile()
    try:
        pipe.compile()
    except ValueError as error:
        return str(error)
    return None


def test_pipeline_compiled_twice_is_refused():
    for message in run_distributed(check_compile_pipeline_twice, world_size=2):
        assert message is not None and "is already compiled; call compile() once" in message


def test_split_cap_is_the_smallest_full_bucket():
    """Pieces of the smallest full bucket end no later than the buckets (compile_split.py)."""
    mb = 1 << 20
    assert BucketCaps.of([9 * mb, 14 * mb, 2 * mb]).bucket_bytes_cap == 14 * mb  # ResNet-9's
    assert BucketCaps.of([mb, 20 * mb, 24 * mb, 3 * mb]).bucket_bytes_cap == 20 * mb
    assert BucketCaps.of([100, 30 * mb]).bucket_bytes_cap == 30 * mb  # two: the second
    assert BucketCaps.of([100]).bucket_bytes_cap == mb  # one bucket: nothing to cut
    assert BucketCaps.of([2 * mb, 100, 200]).bucket_bytes_cap == mb  # never under 1 MB
