"""Tensor parallelism against one process: forward, gradients and 10 optimizer steps.

Every rank builds the one-process model (same seed) as a reference and its tensor-parallel
version with `td.parallelize`; the loss, the gradients (gathered to full shape) and the
parameters after 10 SGD-with-momentum steps must equal the reference's to 1e-5 (float64, so
any mistake in a region or a slice shows far above rounding).
"""

import copy

import pytest
import torch
from torch import nn
from tp_models import PLAN, TinyLM, batch, lm_loss

import tandem as td
from tandem.parallel.tensor.state import sharded_parameters
from tandem.testing import run_distributed

TOL = 1e-5


def _close(a, b):
    return torch.allclose(a, b, rtol=TOL, atol=TOL)


def _full_grads(model):
    shards = sharded_parameters(model)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if name in shards:
            dim, group = shards[name]
            g = td.allgather(g.movedim(dim, 0).contiguous(), group=group).movedim(0, dim)
        grads[name] = g
    return grads


def _compare(what, mine, reference, errors):
    for name, value in reference.items():
        if name not in mine or not _close(mine[name], value):
            errors.append(f"rank {td.rank()} {what} {name}: {mine.get(name)} != {value}")


def train_and_compare(group=None, data_rank=0, data_size=1):
    """Errors of the tp model (over `group`) against one process; the data split over dp ranks."""
    torch.manual_seed(0)
    reference = TinyLM().double()
    model = td.parallelize(copy.deepcopy(reference), PLAN, group)
    errors = []
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if data_size > 1:
        opt = td.DistributedOptimizer(opt, named_parameters=model.named_parameters(), group=data_group())
    for step in range(10):
        ids, target = batch(step, size=4)
        share = slice(data_rank * 4 // data_size, (data_rank + 1) * 4 // data_size)
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss = lm_loss(reference, ids, target, parallel=False)
        ref_loss.backward()
        loss = lm_loss(model, ids[share], target[share], group)
        loss.backward()
        if step == 0 and data_size == 1:
            if not _close(loss, ref_loss):
                errors.append(f"rank {td.rank()} loss {loss.item()} != {ref_loss.item()}")
            reference_grads = {n: p.grad for n, p in reference.named_parameters()}
            _compare("gradient", _full_grads(model), reference_grads, errors)
        ref_opt.step()
        opt.step()
    _compare("after 10 steps", td.full_state_dict(model), reference.state_dict(), errors)
    return errors


_MESH = {}


def data_group():
    return _MESH["mesh"].dp_group


def check_tp_world():
    """The whole world is one tp group: the block, the embedding and the vocab-parallel loss."""
    errors = train_and_compare()
    # The consolidated state dict loads into another tp (here the plain model) and back.
    torch.manual_seed(1)
    model = td.parallelize(TinyLM().double(), PLAN)
    plain = TinyLM().double()
    ids, target = batch(99)
    state = td.full_state_dict(model)
    plain.load_state_dict(state)
    fresh = td.parallelize(TinyLM().double(), PLAN)
    td.load_full_state_dict(fresh, state)
    expected = lm_loss(plain, ids, target, parallel=False)
    for name, m in (("reloaded", fresh), ("original", model)):
        if not _close(lm_loss(m, ids, target), expected):
            errors.append(f"rank {td.rank()} {name} model after full_state_dict differs")
    return errors


def check_dp_tp():
    """dp=2 x tp=2: each replica sees half the batch; gradients average over dp only."""
    mesh = _MESH["mesh"] = td.mesh(dp=2, tp=2)
    errors = []
    if set(mesh.tp_group.ranks) & set(mesh.dp_group.ranks) != {td.rank()} or mesh.tp_group.size != 2:
        errors.append(f"rank {td.rank()}: tp {mesh.tp_group.ranks} and dp {mesh.dp_group.ranks} "
                      "should share only this rank")
    errors += train_and_compare(mesh.tp_group, mesh.dp_rank, mesh.dp)
    return errors


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()


def check_pp_tp():
    """pp=2 x tp=2: each pipeline stage is a tensor-parallel MLP; equals one process."""
    mesh = td.mesh(pp=2, tp=2)
    plan = {"0": "colwise", "2": "rowwise"}
    pipe = td.Pipeline([lambda: td.parallelize(_mlp(0), plan, mesh.tp_group),
                        lambda: td.parallelize(_mlp(1), plan, mesh.tp_group)], chunks=2, group=mesh.pp_group)
    reference = nn.Sequential(_mlp(0), _mlp(1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pipe, reference)]
    errors = []
    for step in range(10):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(8, 8, generator=generator, dtype=torch.float64)
        for opt in opts:
            opt.zero_grad()
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        if loss is not None and not _close(loss, ref_loss):
            errors.append(f"rank {td.rank()} step {step}: pipeline loss {loss} != {ref_loss}")
        for opt in opts:
            opt.step()
    expected = reference[mesh.pp_rank].state_dict()
    _compare("pp x tp after 10 steps", td.full_state_dict(pipe.stage), expected, errors)
    return errors


class TwoBranch(nn.Module):
    def __init__(self, branches: int, dim: int = 6, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, width), nn.Tanh() if i % 2 else nn.ReLU()) for i in range(branches))
        self.head = nn.Linear(branches * width, 1)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        return self.head(torch.cat([b(x) for b in self.branches], dim=-1))


class PlacedBranches(nn.Module):
    def __init__(self, model: TwoBranch, join: str) -> None:
        super().__init__()
        self.stem, self.head = model.stem, model.head
        self.branches = td.Branches(list(model.branches), join=join)

    def forward(self, x):
        return self.head(self.branches(torch.tanh(self.stem(x))))


def check_branches():
    torch.manual_seed(0)
    reference = TwoBranch(td.size()).double()
    model = PlacedBranches(copy.deepcopy(reference), "cat")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (reference, model)]
    errors = []
    for step in range(10):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        losses = []
        for m, opt in zip((reference, model), opts, strict=True):
            opt.zero_grad()
            loss = (m(x) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
            if step == 0 and m is model:
                for p_name in ("stem.weight", "head.weight"):
                    mine = model.get_parameter(p_name).grad
                    if not _close(mine, reference.get_parameter(p_name).grad):
                        errors.append(f"rank {td.rank()} branch gradient {p_name} differs")
            opt.step()
        if not _close(*losses):
            errors.append(f"rank {td.rank()} step {step}: branch loss {losses[1]} != {losses[0]}")
    mine = model.branches.local[0][0].weight
    if not _close(mine, reference.branches[td.rank()][0].weight):
        errors.append(f"rank {td.rank()} branch {td.rank()} weight after 10 steps differs")
    # A sum join: the branches' outputs added across ranks, the gradient back to each.
    summed = td.Branches([nn.Linear(6, 3).double() for _ in range(td.size())], join="sum")
    x = torch.ones(2, 6, dtype=torch.float64, requires_grad=True)
    out = summed(x)
    out.sum().backward()
    mine = summed.local[0](x.detach())
    total = td.allreduce(mine, op="sum")
    if not _close(out.detach(), total):
        errors.append(f"rank {td.rank()} sum join {out} != {total}")
    return errors


def _error_of(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def check_bad_input():
    tp = td.size()
    odd = nn.Sequential(nn.Linear(4, 3 * tp + 1))
    messages = [
        _error_of(lambda: td.parallelize(odd, {"0": "colwise"})),
        _error_of(lambda: td.parallelize(TinyLM(), {"block.mlp.9": "colwise"})),
        _error_of(lambda: td.parallelize(TinyLM(), {"head": "colwise" if td.rank() else "rowwise"})),
        _error_of(lambda: td.mesh(dp=tp + 1, tp=tp)),
    ]
    return messages


@pytest.mark.parametrize("backend,world_size", [("gloo", 2), ("gloo", 3), ("mpi", 2), ("mpi", 3)])
def test_transformer_block_equals_one_process(backend, world_size):
    results = run_distributed(check_tp_world, world_size=world_size, backend=backend)
    assert results == [[]] * world_size, "\n".join(e for errs in results for e in errs)


@pytest.mark.parametrize("backend,world_size", [("gloo", 2), ("mpi", 3)])
def test_branches_on_different_ranks_equal_one_process(backend, world_size):
    results = run_distributed(check_branches, world_size=world_size, backend=backend)
    assert results == [[]] * world_size, "\n".join(e for errs in results for e in errs)


def test_data_and_pipeline_times_tensor_parallel_equal_one_process():
    """One 4-rank world: dp=2 x tp=2, then pp=2 x tp=2 (TP inside each pipeline stage)."""
    for check in (check_dp_tp, check_pp_tp):
        results = run_distributed(check, world_size=4)
        assert results == [[]] * 4, "\n".join(e for errs in results for e in errs)


def test_bad_input_names_the_value_and_the_fix():
    results = run_distributed(check_bad_input, world_size=3)
    for odd, missing, mismatch, mesh in results:
        assert "out_features = 10 is not divisible by tp = 3" in odd and "9 or 12" in odd, odd
        assert "'block.mlp.9'" in missing and "did you mean" in missing, missing
        assert "build the tp groups and the plan the same way" in mismatch, mismatch
        assert "rank" in mismatch and "'head'" in mismatch, mismatch
        assert "needs 12 ranks" in mesh, mesh
