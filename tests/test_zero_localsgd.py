"""ZeroOptimizer and LocalSGD against single-process training, on real ranks.

Each rank also trains a reference copy of the model in-process on the *global* batch with the
plain optimizer, so the comparison needs no extra communication: with mean reduction, k ranks
on B/k samples each must match one process on B samples.
"""

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

STEPS = 10
GLOBAL_BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 3*5+5 + 5*7+7 + 7*2+2 = 78 elements: not a multiple of 4, so the last shard is padded.
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _batch(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 3, generator=generator)
    return x, torch.randn(GLOBAL_BATCH, 2, generator=generator)


def _my_part(tensor: torch.Tensor) -> torch.Tensor:
    per_rank = GLOBAL_BATCH // td.size()
    return tensor[td.rank() * per_rank : (td.rank() + 1) * per_rank]


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    # Two param groups with different hyper-parameters: they must survive sharding.
    first, rest = list(model[0].parameters()), [p for m in (model[2], model[4]) for p in m.parameters()]
    if kind == "sgd":
        return torch.optim.SGD([{"params": first, "lr": 0.05}, {"params": rest}],
                               lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam([{"params": first, "lr": 0.02}, {"params": rest}], lr=0.01)


def _train(model, optimizer, x, y) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def check_zero(kind):
    reference, model = _model(), _model()
    plain = _optimizer(kind, reference)
    zero = td.ZeroOptimizer(_optimizer(kind, model))
    for step in range(STEPS):
        x, y = _batch(step)
        _train(reference, plain, x, y)
        _train(model, zero, _my_part(x), _my_part(y))
    difference = _max_difference(model, reference)
    td.check_replicas(model)
    # Optimizer memory: this rank's share of the unsharded state.
    plain_bytes = sum(v.numel() * v.element_size() for s in plain.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    zero_bytes = sum(v.numel() * v.element_size() for s in zero.optimizer.state.values()
                     for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    # The gathered state dict is the plain optimizer's, and loading it reshards it.
    full = zero.state_dict()
    expected = plain.state_dict()
    assert [g["lr"] for g in full["param_groups"]] == [g["lr"] for g in expected["param_groups"]]
    assert [g["params"] for g in full["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert full["state"].keys() == expected["state"].keys()
    state_difference = max(
        (torch.as_tensor(full["state"][i][k]).double() - torch.as_tensor(v).double()).abs().max().item()
        for i, entry in expected["state"].items() for k, v in entry.items()
    )
    restored_model = _model()
    restored_model.load_state_dict(model.state_dict())
    restored = td.ZeroOptimizer(_optimizer(kind, restored_model))
    restored.load_state_dict(full)
    x, y = _batch(STEPS)
    _train(model, zero, _my_part(x), _my_part(y))
    _train(restored_model, restored, _my_part(x), _my_part(y))
    assert _max_difference(model, restored_model) == 0.0
    return {"difference": difference, "state_difference": state_difference,
            "plain_bytes": plain_bytes, "zero_bytes": zero_bytes, "state_bytes": zero.state_bytes()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_zero_matches_single_process_training_with_a_share_of_the_state(kind):
    results = run_distributed(check_zero, world_size=2, args=(kind,))
    for rank, r in enumerate(results):
        assert r["difference"] < 1e-5, (rank, r)
        assert r["state_difference"] < 1e-5, (rank, r)
        # 78 elements -> shards of 39: exactly half the per-element state on each rank.
        assert r["zero_bytes"] == r["plain_bytes"] // 2, (rank, r)
        assert r["state_bytes"] <= r["plain_bytes"] // 2 + 16, (rank, r)


def check_zero_clip(norm_type):
    """ZeroOptimizer.clip_grad_norm_ clips the averaged gradient by its global norm, as
    nn.utils.clip_grad_norm_ does in one process (the norm is returned equal too)."""
    reference, model = _model(), _model()
    ref_opt = _optimizer("adam", reference)
    opt = td.ZeroOptimizer(_optimizer("adam", model))
    norms = []
    per_rank = 12 // td.size()  # a global batch of 12: 2 and 3 ranks (78 elements: uneven shards)
    mine = slice(td.rank() * per_rank, (td.rank() + 1) * per_rank)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 3, generator=generator), torch.randn(12, 2, generator=generator)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type)
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        got = opt.clip_grad_norm_(0.05, norm_type=norm_type)
        opt.step()
        norms.append(abs(float(got) - float(expected)))
    return max(norms), _max_difference(model, reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_clip_grad_norm_uses_the_global_norm_of_the_average(world_size):
    for norm_type in (2.0, float("inf")):
        for rank, (norm_error, difference) in enumerate(
                run_distributed(check_zero_clip, world_size=world_size, args=(norm_type,))):
            # float32 sums over B vs B/k samples: the same rounding as the equivalence tests.
            assert norm_error <= 1e-6 and difference <= 1e-5, (rank, norm_type, norm_error, difference)


def check_local_sgd():
    # period 1 with plain SGD: averaging parameters each step == averaging gradients.
    reference, model = _model(), _model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    local = td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=1)
    for step in range(STEPS):
        x, y = _batch(step)
        _train(reference, plain, x, y)
        _train(model, local, _my_part(x), _my_part(y))
    synchronous_difference = _max_difference(model, reference)
    # period 3 with momentum: replicas drift apart between averages and agree after each.
    model = _model()
    local = td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), period=3)
    agreed_after = []
    for step in range(9):
        x, y = _batch(step)
        _train(model, local, _my_part(x), _my_part(y))
        try:
            td.check_replicas(model)
            agreed_after.append(step + 1)
        except td.errors.ReplicaMismatchError:
            pass
    _train(model, local, *map(_my_part, _batch(9)))
    local.average()
    td.check_replicas(model)
    # Both wrap the plain optimizer: a DistributedOptimizer would reduce gradients twice.
    reducing = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    for wrap in (td.ZeroOptimizer, lambda o: td.LocalSGD(o, period=2)):
        try:
            wrap(reducing)
            raise AssertionError(f"{wrap} accepted a DistributedOptimizer")
        except TypeError as error:
            assert "plain torch optimizer" in str(error)
    return {"synchronous_difference": synchronous_difference, "agreed_after": agreed_after}


@pytest.mark.timeout(120)
def test_local_sgd_averages_every_period():
    for r in run_distributed(check_local_sgd, world_size=2):
        assert r["synchronous_difference"] < 1e-5, r
        assert r["agreed_after"] == [3, 6, 9], r


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="period must be a positive int"):
        td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=0)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        td.ZeroOptimizer(model)
