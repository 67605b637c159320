"""FSDP2's per-module API where a `td.fully_shard` port meets it (issue 43, item 4): the FSDP2
example's `inspect_mixed_precision` (pytorch/examples distributed/FSDP2/utils.py) as upstream
has it, `isinstance(model, FSDPModule)` with the one import changed to `tandem.fsdp`, and a
forward after `model.unshard()` that equals one without it. `tandem.fsdp.fully_shard`'s DTensor
parameters and state-dict entries (`parallel/fully_shard/dtensor.py`): the same steps as
`td.fully_shard`'s plain shards, torch's own clip_grad_norm_ the global norm, and the FSDP2
example's whole flow (tests/scripts/fsdp2_port.py: both checkpointers, save then resume) under
`tandem run` on Gloo and MPI, its resume bit-identical to an uninterrupted run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.fsdp import FSDPModule  # torch.distributed.fsdp's FSDPModule in the example
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None


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


def _port_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 3))


def _train(model, clip):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(td.rank()))
    norms = []
    for _ in range(3):
        model(x).square().mean().backward()
        norms.append(float(clip(model)))
        optimizer.step()
        optimizer.zero_grad()
    return norms, optimizer


def check_dtensor_parameters():
    """tandem.fsdp.fully_shard against td.fully_shard on the same model and data."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    td.init()
    plain = _port_model()
    for layer in (plain[0], plain[2], plain):
        td.fully_shard(layer)
    plain_norms, _ = _train(plain, lambda m: td.clip_grad_norm_(m, 1e9))
    model = _port_model()
    for layer in (model[0], model[2], model):
        td.fsdp.fully_shard(layer)
    params = list(model.parameters())
    seen = {"params": [(type(p).__name__, p.placements, p.device_mesh.size(), tuple(p.shape),
                        tuple(p.to_local().shape)) for p in params]}
    norms, optimizer = _train(  # torch's own clipping: the global norm, as under FSDP2
        model, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
    seen["norms"], seen["plain_norms"] = norms, plain_norms
    state = model.state_dict()
    seen["entries"] = sorted({(type(v).__name__, v.placements) for v in state.values()},
                             key=str)
    full = {k: v.full_tensor() for k, v in state.items()}
    seen["same_as_plain"] = all(torch.equal(full[k], v)
                                for k, v in plain.state_dict().items())
    seen["moments"] = sorted({type(v).__name__ for st in optimizer.state.values()
                              for k, v in st.items() if k != "step"})
    # distribute_tensor of rank 0's values, load_state_dict(assign=True), as the example does
    from torch.distributed.tensor import distribute_tensor

    loaded = _port_model()
    for layer in (loaded[0], loaded[2], loaded):  # FSDP2's defaults spelled out: no offload
        td.fsdp.fully_shard(layer, reshard_after_forward=None,
                            offload_policy=torch.distributed.fsdp.OffloadPolicy())
    sharded = {k: nn.Parameter(distribute_tensor(full[k], v.device_mesh, v.placements))
               for k, v in loaded.state_dict().items()}
    loaded.load_state_dict(sharded, strict=False, assign=True)
    seen["loaded"] = all(torch.equal(loaded.state_dict()[k].full_tensor(), v)
                         for k, v in full.items())
    seen["loaded_params"] = [type(p).__name__ for p in loaded.parameters()]
    x = torch.randn(2, 8)
    seen["loaded_forward"] = torch.equal(loaded(x), model(x))
    refused = []
    for kwargs in ({"offload_policy": td.fsdp.CPUOffloadPolicy()}, {"mesh": td.mesh(dp=2)}):
        try:
            td.fsdp.fully_shard(nn.Linear(2, 2), **kwargs)
        except ValueError as error:
            refused.append(str(error))
    seen["refused"] = refused
    seen["types"] = (DTensor.__name__, Shard(0), Replicate())
    return seen


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_fsdp2_fully_shard_gives_dtensor_parameters_that_step_as_the_plain_shards(backend):
    if backend == "mpi" and not HAVE_MPI:
        pytest.skip("needs mpi4py")
    from torch.distributed.tensor import Replicate, Shard

    for seen in run_distributed(check_dtensor_parameters, world_size=2, backend=backend):
        # one flat DTensor per unit, Shard(0) over the world: its global tensor the padded space
        assert seen["params"] == [("DTensor", (Shard(0),), 2, (28,), (14,)),  # the root's
                                  ("DTensor", (Shard(0),), 2, (144,), (72,)),
                                  ("DTensor", (Shard(0),), 2, (136,), (68,))]
        assert seen["entries"] == [("DTensor", (Replicate(),))]
        assert seen["moments"] == ["DTensor"]
        assert seen["same_as_plain"]  # the same steps, bit for bit
        assert seen["norms"] == pytest.approx(seen["plain_norms"], rel=1e-6)
        assert seen["loaded"] and seen["loaded_forward"]
        assert seen["loaded_params"] == ["DTensor"] * 3
        assert len(seen["refused"]) == 2
        assert "offload_policy=" in seen["refused"][0] and "td.fully_shard" in seen["refused"][0]
        assert "1-D mesh over the whole world" in seen["refused"][1]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_fsdp2_examples_flow_ported_resumes_bit_identically(backend, tmp_path):
    """tests/scripts/fsdp2_port.py: the example's flow (meta model, inspect_model, both
    checkpointers, save then resume, torch's clip_grad_norm_) under tandem run, with
    tandem.fsdp's fully_shard and with torch's own FSDP2 on the same group; MPI with
    --mixed-precision (the example's inspect_mixed_precision) and --explicit-prefetching
    (model.unshard() before each step, the prefetch setters)."""
    if backend == "mpi" and not HAVE_MPI:
        pytest.skip("needs mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["FSDP2_PORT_BACKEND"] = backend
    extra = ["--mixed-precision", "--explicit-prefetching"] if backend == "mpi" else []
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", backend,
                           str(ROOT / "tests/scripts/fsdp2_port.py"), str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["backend"] == backend
    for impl in ("tandem", "torch"):
        for api in ("dcp", "dtensor"):
            assert summary["inspect"][f"{impl}/{api}"] == [["DTensor", "(Shard(dim=0),)", 2]]
            for what in ("model", "optim"):  # resumed == uninterrupted, bit for bit
                assert summary["equal"][f"{impl}/{api}/{what}"], (impl, api, what)
    for key, compared in summary["torch_vs_tandem"].items():  # torch's FSDP2: its rounding
        assert compared["max_abs_diff"] < 1e-5, (key, compared)
