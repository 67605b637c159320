"""`td.memory.estimate_memory` given the model and optimizer you train: their owners say the
layout, the optimizer's name and the world size, and the estimate equals the one the names give.

A split the estimate cannot see whole (a pipeline stage, tensor-parallel slices) and an optimizer
whose state it does not know are refused with the fix; the name form is unchanged
(tests/test_memory_estimate.py).
"""

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 4))


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def estimates() -> dict:
    estimate = td.memory.estimate_memory
    n = td.size()
    out = {}
    model = _net()
    out["adam"] = (estimate(model, optimizer=torch.optim.Adam(model.parameters())),
                   estimate(model, world_size=n, layout="ddp", optimizer="adam"))
    out["ddp sgd-momentum"] = (
        estimate(model, optimizer=td.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))),
        estimate(model, world_size=n, layout="ddp", optimizer="sgd-momentum"))
    out["zero adamw"] = (estimate(model, optimizer=td.ZeroOptimizer(torch.optim.AdamW(model.parameters()))),
                         estimate(model, world_size=n, layout="zero", optimizer="adamw"))
    sharded = _net()
    td.fully_shard(sharded[0])
    td.fully_shard(sharded)
    out["fully_shard"] = (estimate(sharded, optimizer=torch.optim.Adam(sharded.parameters())),
                          estimate(sharded, world_size=n, layout="fully_shard", optimizer="adam"))
    # the name of a layout still wins over what the objects say
    out["named layout"] = (estimate(model, layout="zero", optimizer=torch.optim.Adam(model.parameters())),
                           estimate(model, world_size=n, layout="zero", optimizer="adam"))
    errors = {
        "tensor parallel": _error(lambda: estimate(td.parallelize(_net(), {"1": "colwise"}))),
        "rmsprop": _error(lambda: estimate(model, optimizer=torch.optim.RMSprop(model.parameters()))),
        "not an optimizer": _error(lambda: estimate(model, optimizer=object())),
    }
    return {"same": {k: a == b for k, (a, b) in out.items()},
            "layouts": {k: a.layout for k, (a, _) in out.items()},
            "world": {k: a.world_size for k, (a, _) in out.items()}, "errors": errors}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_estimate_asks_the_owners_of_the_model_and_optimizer(backend):
    for got in run_distributed(estimates, world_size=2, backend=backend):
        assert all(got["same"].values()), got
        assert got["layouts"] == {"adam": "ddp", "ddp sgd-momentum": "ddp", "zero adamw": "zero",
                                  "fully_shard": "fully_shard", "named layout": "zero"}, got
        assert set(got["world"].values()) == {2}, got
        errors = got["errors"]
        assert errors["tensor parallel"].startswith("ValueError: "), errors
        assert "is split (tensor parallel)" in errors["tensor parallel"], errors
        assert "layout='tp', plan=" in errors["tensor parallel"], errors
        assert "not td.ZeroOptimizer" not in errors["rmsprop"] and "RMSprop" in errors["rmsprop"], errors
        assert "optimizer= takes a name" in errors["not an optimizer"], errors


def test_a_meta_model_and_its_optimizer_without_a_job():
    model = _net().to("meta")
    got = td.memory.estimate_memory(model, world_size=4,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert got == td.memory.estimate_memory(model, world_size=4, layout="ddp", optimizer="sgd")
