"""td.fully_shard's ranks agree on what they build, or every rank raises naming each rank's choice.

The gathers and reduce-scatters of a unit are not checked one call at a time, so whatever
decides what they send is agreed once, when the unit is made (issue 42): the mixed-precision
policy (rank 0 in bf16, rank 1 in fp32 read each other's bytes: inf then NaN parameters on MPI,
an abort on Gloo), the offload policy, `reshard_after_forward`, the mesh. `td.materialize`'s
seed too (a seed per rank gave each rank its shard of a different model). And an optimizer over
another model's parameters, while the sharded model is the one that gets gradients, is refused
at its first step (it trained nothing). Each check catches what tandem raises on every rank and
returns it; after the errors the same world trains a consistent model, so nothing was left in
flight.
"""

import importlib.util

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _error(call) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _train(model: nn.Module, steps: int = 3) -> float:
    """A few steps on fixed data; the loss of the last, as this rank sees it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(td.rank())
    x, y = torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


# -- 1. the settings of a unit ------------------------------------------------------------------

def check_settings():
    bf16 = td.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    first = td.rank() == 0
    said = {
        "mp_policy": _error(lambda: td.fully_shard(_mlp(), mp_policy=bf16 if first else None)),
        "reduce_dtype": _error(lambda: td.fully_shard(_mlp(), mp_policy=td.fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if first else None))),
        "offload": _error(lambda: td.fully_shard(
            _mlp(), offload_policy=td.fsdp.CPUOffloadPolicy() if first else None)),
        "reshard": _error(lambda: td.fully_shard(_mlp(), reshard_after_forward=first)),
    }
    mesh = td.mesh(dp=2)  # made on every rank (a collective); passed by rank 0 only
    said["mesh"] = _error(lambda: td.fully_shard(_mlp(), mesh=mesh if first else None))
    # An inner unit that disagrees is named too, before the root is sharded.
    model = _mlp()
    said["inner"] = _error(lambda: td.fully_shard(model[0], mp_policy=bf16 if first else None))
    # The same policy spelt as torch's FSDP2 class on one rank and tandem's on the other agrees.
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    same = TorchPolicy(param_dtype=torch.bfloat16) if first else bf16
    said["torch_policy_loss"] = _train(td.fully_shard(_mlp(), mp_policy=same))
    said["after"] = _train(td.fully_shard(_mlp(), mp_policy=bf16))  # the world is in step
    return said


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_different_fully_shard_settings_are_named(backend):
    results = run_distributed(check_settings, 2, backend, timeout=120)
    for rank, said in enumerate(results):
        text = said["mp_policy"]
        assert text.startswith("LayoutMismatchError: fully_shard of Sequential: the ranks passed "
                               "different settings"), (rank, text)
        assert "rank 0: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=None" in text, text
        assert "rank 1: none (the parameters' own dtype)" in text, text
        assert "Pass the same mp_policy" in text and "on every rank" in text, text
        assert "offload_policy:" not in text, text  # only what differs is listed
        assert "reduce_dtype=float32" in said["reduce_dtype"], said["reduce_dtype"]
        assert "rank 0: CPUOffloadPolicy(pin_memory=True)" in said["offload"], said["offload"]
        assert "rank 1: none" in said["offload"], said["offload"]
        assert "rank 0: True" in said["reshard"] and "rank 1: False" in said["reshard"], said
        assert ("  group/mesh:\n    rank 0: mesh of 2 replicas x 1 shards (td.mesh(dp=2, shard=1))"
                in said["mesh"]), said["mesh"]
        assert "rank 1: shards over ranks [0, 1]" in said["mesh"], said["mesh"]
        assert "fully_shard of Linear" in said["inner"] and "mp_policy" in said["inner"], said
        for key in ("torch_policy_loss", "after"):
            assert said[key] == said[key] and abs(said[key]) < float("inf"), (rank, key, said[key])


# -- 2. td.materialize's seed ---------------------------------------------------------------------

def _meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    td.fully_shard(model[0])
    return td.fully_shard(model)


def _one_process(seed_state: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed_state)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).state_dict()


def _difference(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    full = td.fsdp.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in reference.items())


def check_materialize_seeds():
    said = {
        "per_rank": _error(lambda: td.fsdp.materialize(_meta_mlp(), seed=td.rank())),
        "some_none": _error(lambda: td.fsdp.materialize(_meta_mlp(), seed=None if td.rank() else 7)),
    }
    # No seed: every rank takes rank 0's RNG state, however the ranks' states differ.
    torch.manual_seed(100 + td.rank())
    said["no_seed"] = _difference(td.fsdp.materialize(_meta_mlp()), _one_process(100))
    said["seeded"] = _difference(td.fsdp.materialize(_meta_mlp(), seed=5), _one_process(5))
    return said


@pytest.mark.parametrize("backend", BACKENDS)
def test_materialize_seeds_must_agree(backend):
    results = run_distributed(check_materialize_seeds, 2, backend, timeout=120)
    for rank, said in enumerate(results):
        text = said["per_rank"]
        assert text.startswith("CollectiveMismatchError: td.fsdp.materialize: the ranks passed "
                               "different seeds"), (rank, text)
        assert "rank 0: seed=0" in text and "rank 1: seed=1" in text, text
        assert "pass the same seed on every rank" in text, text
        text = said["some_none"]
        assert "rank 0: seed=7" in text and "rank 1: seed=None (rank 0's RNG state)" in text, text
        assert said["no_seed"] == 0.0 and said["seeded"] == 0.0, (rank, said)


# -- 8. an optimizer over another model's parameters ----------------------------------------------

def _wrong_optimizer(offload: bool) -> tuple[str, float]:
    model = td.fully_shard(_mlp(), offload_policy=td.fsdp.CPUOffloadPolicy() if offload else None)
    other = _mlp()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    said = _error(opt.step)
    for p in model.parameters():  # leave no gradient behind for later checks in this world
        p.grad = None
    return said, sum(p.abs().sum().item() for p in other.parameters())


def _two_models() -> str:
    """Legitimate: a sharded model and a plain one, each with its optimizer, both trained."""
    model, other = td.fully_shard(_mlp()), _mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, other)]
    x = torch.randn(4, 3)
    loss = nn.functional.mse_loss(other(torch.tanh(model(x)[:, :1]).expand(4, 3)), torch.zeros(4, 2))
    loss.backward()
    return _error(opts[1].step) + " / " + _error(opts[0].step)


def check_wrong_optimizer():
    return {"offload": _wrong_optimizer(True), "plain": _wrong_optimizer(False),
            "two_models": _two_models()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_over_another_model_is_refused(backend):
    results = run_distributed(check_wrong_optimizer, 2, backend, timeout=120)
    untouched = sum(p.abs().sum().item() for p in _mlp().parameters())
    for rank, said in enumerate(results):
        for case in ("offload", "plain"):
            text, values = said[case]
            assert text.startswith(f"ValueError: rank {rank}: SGD holds 4 parameters, none of "
                                   f"them a td.fully_shard shard"), (rank, case, text)
            assert "opt = torch.optim.SGD(model.parameters(), ...)" in text, text
            assert values == untouched, (rank, case)  # refused before it stepped anything
        assert said["two_models"] == "no error / no error", said["two_models"]
