"""td.fully_shard against single-process training, on real ranks (Gloo 2 and 3, MPI 2).

Each rank also trains a plain copy of the model on the *global* batch, so the comparison needs
no extra communication: k ranks on B/k samples each must match one process on B samples to
1e-5 after 20 steps. One world runs every case (SGD with momentum and Adam, an MLP and a
transformer block, clipping, accumulation with gradient sync off), then the properties that
make it fully sharded: 1/N of each unit per rank, gathered storage freed after forward,
GradScaler skipping the same step on every rank, bf16 compute.
"""

import copy

import pytest
import torch
from torch import nn

import tandem as td
from tandem.parallel.fully_shard import units
from tandem.testing import run_distributed

STEPS = 20
BATCH = 12  # divisible by 2 and 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # Units of 20, 42 and 16 elements: uneven over 3 ranks, so shards are padded.
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 8)
        self.layer = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)))


def _shard(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    inner = [model[0], model[2]] if isinstance(model, nn.Sequential) else [model.layer.self_attn,
                                                                            model.layer]
    for module in inner:
        td.fully_shard(module)
    return td.fully_shard(model)


def _data(step: int, transformer: bool):
    generator = torch.Generator().manual_seed(1000 + step)
    shape = (BATCH, 4, 3) if transformer else (BATCH, 3)
    x = torch.randn(*shape, generator=generator)
    return x, torch.randn(*shape[:-1], 2, generator=generator)


def _mine(tensor: torch.Tensor) -> torch.Tensor:
    per_rank = BATCH // td.size()
    return tensor[td.rank() * per_rank : (td.rank() + 1) * per_rank]


def _optimizer(kind: str, model: nn.Module):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    # eps: the key bias of attention has a zero gradient in exact arithmetic, and Adam with a
    # tiny eps turns its float noise (which differs between B and B/k samples) into full steps.
    return torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)


def _difference(sharded: nn.Module, reference: nn.Module) -> float:
    full = td.fsdp.full_state_dict(sharded)
    assert full.keys() == reference.state_dict().keys(), sorted(full)
    return max((full[k].cpu() - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())


def _case(kind: str, transformer: bool, clip: bool, accumulate: int, device: str = "cpu") -> float:
    reference = (_Block() if transformer else _mlp()).to(device)
    model = _shard(reference)
    plain, sharded = _optimizer(kind, reference), _optimizer(kind, model)
    for step in range(STEPS):
        x, y = (t.to(device) for t in _data(step, transformer))
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        if clip:
            nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        plain.step()
        sharded.zero_grad()
        xs, ys = _mine(x).chunk(accumulate), _mine(y).chunk(accumulate)
        for micro, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            td.fsdp.set_requires_gradient_sync(model, micro == accumulate - 1)
            (nn.functional.mse_loss(model(xm), ym) / accumulate).backward()
        if clip:
            norm = td.clip_grad_norm_(model, 0.05)
            assert norm > 0.05, norm  # the clipping did something
        sharded.step()
    difference = _difference(model, reference)
    # The consolidated optimizer state equals the plain optimizer's, parameter by parameter.
    full = td.fsdp.full_optimizer_state_dict(model, sharded)
    for name, param in reference.named_parameters():
        for key, value in plain.state[param].items():
            got, value = torch.as_tensor(full["state"][name][key]), torch.as_tensor(value)
            difference = max(difference, (got.cpu() - value.cpu()).abs().max().item())
    return difference


# (optimizer, transformer block?, clip?, micro-batches): all on 2 ranks, a half each elsewhere.
CASES = [("sgd", False, False, 1), ("adam", True, False, 2), ("adam", False, True, 1), ("sgd", True, True, 2)]


def check_equivalence(cases, device: str = "cpu"):
    """Each case on this rank, with models and data on `device` (test_cuda_parallel.py: the GPU)."""
    return {case: _case(*case, device=device) for case in cases}


def check_sharding():
    """1/N per rank, storage freed after forward, GradScaler's skip agreed, bf16 compute."""
    reference = _mlp()
    model = _shard(reference)
    found = dict(units(model))
    shards = {name: (unit.numel, unit.shard.numel()) for name, unit in found.items()}
    out = model(torch.randn(4, 3))
    # Inner units are freed once their forward is done; the root stays gathered until backward.
    freed = {name: unit.freed() for name, unit in found.items()}
    out.sum().backward()
    after_backward = {name: unit.freed() for name, unit in found.items()}
    # GradScaler: rank 0 alone sees inf; every rank must skip the step and lower the scale.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = td.fsdp.full_state_dict(model)
    optimizer.zero_grad()
    x = torch.randn(4, 3)
    if td.rank() == 0:
        x[0, 0] = float("inf")
    scaler.scale(nn.functional.mse_loss(model(x), torch.zeros(4, 2))).backward()
    scaler.step(optimizer)
    scaler.update()
    skipped = all(torch.equal(before[k], v) for k, v in td.fsdp.full_state_dict(model).items())
    scale = scaler.get_scale()
    # bf16 compute: gathers in bf16, fp32 master shards; training still agrees with fp32 closely.
    bf16 = copy.deepcopy(reference)
    td.fully_shard(bf16, param_dtype=torch.bfloat16)
    seen = []
    bf16.register_forward_hook(lambda m, a, o: seen.append(m[0].weight.dtype))
    optimizer = torch.optim.SGD(bf16.parameters(), lr=0.05)
    for step in range(3):
        x, y = _data(step, False)
        optimizer.zero_grad()
        nn.functional.mse_loss(bf16(_mine(x).bfloat16()).float(), _mine(y)).backward()
        optimizer.step()
    masters = {p.dtype for p in bf16.parameters()}
    # A root with no parameters of its own (a container of units) orders and prefetches them.
    plain, container = _mlp(), _mlp()
    for i in (0, 2, 4):
        td.fully_shard(container[i])
    td.fully_shard(container)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, container)]
    for step in range(3):
        x, y = _data(step, False)
        for m, opt, xs, ys in ((plain, optimizers[0], x, y), (container, optimizers[1], _mine(x), _mine(y))):
            opt.zero_grad()
            nn.functional.mse_loss(m(xs), ys).backward()
            opt.step()
    container_difference = _difference(container, plain)
    # Wrapping a module twice names the module and the fix.
    try:
        td.fully_shard(model)
        twice = None
    except ValueError as error:
        twice = str(error)
    wrapped = []
    names = list(model.named_parameters())
    for wrap in (td.ZeroOptimizer, lambda o: td.DistributedOptimizer(o, named_parameters=names)):
        try:
            wrap(torch.optim.SGD(model.parameters(), lr=0.1))
        except TypeError as error:
            wrapped.append(str(error))
    return {"wrapped": wrapped, "shards": shards, "freed": freed, "after_backward": after_backward,
            "skipped": skipped, "scale": scale, "seen": seen, "masters": masters,
            "twice": twice, "container_difference": container_difference}


def _assert_equivalent(results):
    for rank, cases in enumerate(results):
        for case, difference in cases.items():
            assert difference < 1e-5, (rank, case, difference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_fully_shard_matches_one_process(world_size):
    cases = CASES if world_size == 2 else CASES[2:]
    _assert_equivalent(run_distributed(check_equivalence, world_size=world_size, args=(cases,),
                                       timeout=240))
    for rank, r in enumerate(run_distributed(check_sharding, world_size=world_size)):
        for name, (numel, shard) in r["shards"].items():
            assert shard == -(-numel // world_size), (rank, name, numel, shard)
        assert r["freed"] == {"": False, "0": True, "2": True}, (rank, r["freed"])
        assert all(r["after_backward"].values()), (rank, r["after_backward"])
        assert r["skipped"] and r["scale"] == 2.0, (rank, r)
        assert set(r["seen"]) == {torch.bfloat16} and r["masters"] == {torch.float32}, (rank, r)
        assert "already fully sharded" in r["twice"], (rank, r["twice"])
        assert r["container_difference"] < 1e-6, (rank, r["container_difference"])
        assert len(r["wrapped"]) == 2 and all("plain torch optimizer" in e for e in r["wrapped"]), r


@pytest.mark.timeout(300)
def test_fully_shard_matches_one_process_on_mpi():
    pytest.importorskip("mpi4py")
    _assert_equivalent(run_distributed(check_equivalence, world_size=2, backend="mpi",
                                       args=(CASES[:2],), timeout=240))
