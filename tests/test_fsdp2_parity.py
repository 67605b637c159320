"""FSDP2's per-module API where a `td.fully_shard` port meets it (issue 43, item 4): the FSDP2
example's `inspect_mixed_precision` (pytorch/examples distributed/FSDP2/utils.py) as upstream
has it, `isinstance(model, FSDPModule)` with the one import changed to `tandem.fsdp`, and a
forward after `model.unshard()` that equals one without it."""

import pytest
import torch
from torch import nn

import tandem as td
from tandem.fsdp import FSDPModule  # torch.distributed.fsdp's FSDPModule in the example
from tandem.testing import run_distributed


def inspect_mixed_precision(model: FSDPModule):  # the example's, verbatim
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 4))
    policy = td.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    td.fully_shard(model[0], mp_policy=policy)
    td.fully_shard(model[2], mp_policy=policy)
    td.fully_shard(model, mp_policy=policy)  # the root holds model[3]'s parameters
    return model


def check_unshard_in_param_dtype_and_fsdp_module():
    td.init()
    model = _model()
    seen = {"fsdp": isinstance(model, FSDPModule), "inner": isinstance(model[0], FSDPModule),
            "plain": isinstance(nn.Linear(2, 2), FSDPModule),
            "torch": isinstance(model, torch.distributed.fsdp.FSDPModule)}
    inspect_mixed_precision(model)
    model.unshard()
    seen["own"] = list(model.named_parameters(recurse=False))  # FSDP2's: none on the root
    seen["unsharded"] = sorted((name, p.dtype, tuple(p.shape))
                               for name, p in model.named_parameters())
    model.reshard()
    seen["resharded"] = [(name, p.dtype) for name, p in model.named_parameters(recurse=False)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(td.rank()))
    losses = []
    for step in range(4):  # unshard() before every other forward: the same steps
        if step % 2:
            model.unshard()
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    seen["state"] = {k: v.float().tolist() for k, v in model.state_dict().items()}
    seen["losses"] = losses
    return seen


def check_reference():
    td.init()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(td.rank()))
    losses = []
    for _ in range(4):
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"state": {k: v.float().tolist() for k, v in model.state_dict().items()}, "losses": losses}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_unshard_gives_the_policys_dtype_and_the_port_is_an_fsdp_module(backend):
    results = run_distributed(check_unshard_in_param_dtype_and_fsdp_module, world_size=2,
                              backend=backend)
    reference = run_distributed(check_reference, world_size=2, backend=backend)
    for seen, expected in zip(results, reference, strict=True):
        assert (seen["fsdp"], seen["inner"], seen["plain"], seen["torch"]) == (True, True, False,
                                                                                False)
        assert seen["own"] == []
        assert seen["unsharded"] == [("0._tandem_shard", torch.float32, (72,)),
                                     ("2._tandem_shard", torch.float32, (68,)),
                                     ("3.bias", torch.bfloat16, (4,)),
                                     ("3.weight", torch.bfloat16, (4, 8))]
        assert seen["resharded"] == [("_tandem_shard", torch.float32)]
        assert seen["losses"] == expected["losses"]
        for name, value in expected["state"].items():
            assert seen["state"][name] == value, name
