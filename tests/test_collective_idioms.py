"""The collectives give the right answer in both idioms users bring: in place (torch's
`dist.all_reduce(p.grad)`) and returned (Horovod's `t = hvd.allreduce(t)`), with torch's keyword
names (`src=`, `dst=`, `ReduceOp`)."""

import pytest
import torch
import torch.distributed as dist

import tandem as td
from tandem.testing import run_distributed


def check_seed_002_port_averages_gradients_in_place():
    """Seed 002's loop, `dist.all_reduce(param.grad.data, ...)` ported to tandem's name."""
    td.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    torch.manual_seed(100 + td.rank())  # each rank its own batch
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    for param in model.parameters():
        td.allreduce(param.grad.data, op="sum")
        param.grad.data /= td.size()
    return [p.grad.tolist() for p in model.parameters()]  # lists cross the pipe


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_td_allreduce_in_place_as_torch_users_write_it_keeps_the_replicas_equal(backend):
    grads = run_distributed(check_seed_002_port_averages_gradients_in_place, 2, backend)
    assert grads[0] == grads[1]  # bitwise: each rank holds the sum over both batches
    assert any(v != 0 for row in grads[0][0] for v in row)


def check_both_idioms():
    td.init()
    rank = td.rank()
    t = torch.full((3,), float(rank + 1))
    returned = td.allreduce(t, op="sum")
    kept = torch.full((3,), float(rank + 1))
    copy = td.allreduce(kept, op="sum", inplace=False)
    torch_op = td.allreduce(torch.full((2,), float(rank + 1)), op=dist.ReduceOp.SUM)
    mean = td.allreduce(torch.full((2,), float(rank + 1)), op=dist.ReduceOp.AVG)
    b = td.broadcast(torch.full((2,), float(rank)), src=1)
    r = td.reduce(torch.full((2,), float(rank + 1)), dst=1)
    handle = td.allreduce(torch.full((2,), float(rank + 1)), op="max", async_op=True)
    gathered = td.gather(torch.full((1,), float(rank)), dst=1)
    part = td.scatter(torch.arange(2.0) + 10 * rank, src=1)
    return {
        "returned is t": returned is t, "t": t.tolist(), "kept": kept.tolist(),
        "copy": copy.tolist(), "torch_op": torch_op.tolist(), "mean": mean.tolist(),
        "broadcast": b.tolist(), "reduce": r.tolist(), "async": handle.wait().tolist(),
        "gather": None if gathered is None else gathered.tolist(), "scatter": part.tolist(),
    }


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_in_place_and_returned_and_torch_keyword_names(backend):
    results = run_distributed(check_both_idioms, 2, backend)
    for rank, got in enumerate(results):
        assert got["returned is t"] and got["t"] == [3.0] * 3
        assert got["kept"] == [rank + 1.0] * 3 and got["copy"] == [3.0] * 3  # inplace=False
        assert got["torch_op"] == [3.0, 3.0] and got["mean"] == [1.5, 1.5]
        assert got["broadcast"] == [1.0, 1.0]
        assert got["reduce"] == ([3.0, 3.0] if rank == 1 else [1.0, 1.0])
        assert got["async"] == [2.0, 2.0]
        assert got["gather"] == ([0.0, 1.0] if rank == 1 else None)
        assert got["scatter"] == [10.0 + rank]


def check_bad_spellings():
    td.init()
    errors = []
    for call in (lambda: td.broadcast(torch.ones(2), root=1, src=0),
                 lambda: td.reduce(torch.ones(2), root=1, dst=0),
                 lambda: td.allreduce(torch.ones(2), op="average")):
        t = torch.ones(2)
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
        assert t.tolist() == [1.0, 1.0]
    return errors


def test_two_names_for_two_ranks_or_an_unknown_op_are_refused_before_anything_moves():
    errors = run_distributed(check_bad_spellings, 2)[0]
    assert "root=1 and src=0 name different ranks" in errors[0]
    assert "root=1 and dst=0 name different ranks" in errors[1]
    assert "unknown op 'average'" in errors[2]
