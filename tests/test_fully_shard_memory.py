"""fully_shard for models that do not fit, against one process on real ranks (Gloo 2 and 4, MPI 2).

Meta-device construction with `td.materialize` (each rank's shard equals the slice of the
one-process model built eagerly with the same seed: exactly), CPU offload, mixed-precision
policies and HSDP (`td.mesh(dp=2, shard=size // 2)`). Each rank trains a plain copy of the
model on the global batch beside the sharded one, as tests/test_fully_shard.py does; one world
per size runs every case, then the bad inputs.
"""

import shutil
import tempfile

import pytest
import torch
from torch import nn

import tandem as td
from tandem.parallel.fully_shard import units
from tandem.testing import run_distributed

STEPS = 6
BATCH = 8  # divisible by 2 and 4
SEED = 7


class Net(nn.Module):
    """embed, two transformer blocks (units of their own), head: the root holds embed and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _eager() -> nn.Module:
    torch.manual_seed(SEED)
    return Net()


def _sharded(meta: bool, **options) -> nn.Module:
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = _eager()
    for block in model.blocks:
        td.fully_shard(block, **options)
    td.fully_shard(model, **options)
    if meta:
        torch.manual_seed(SEED + 1)  # materialize(seed=) must not depend on the RNG before it
        td.fsdp.materialize(model, seed=SEED)
    return model


def _data(step: int):
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 4, 3, generator=generator), torch.randn(BATCH, 4, 2, generator=generator)


def _mine(tensor: torch.Tensor) -> torch.Tensor:
    per_rank = BATCH // td.size()
    return tensor[td.rank() * per_rank : (td.rank() + 1) * per_rank]


def _difference(model: nn.Module, reference: nn.Module) -> float:
    full = td.fsdp.full_state_dict(model)
    assert full.keys() == reference.state_dict().keys(), sorted(full)
    return max((full[k].float() - v).abs().max().item() for k, v in reference.state_dict().items())


def _train(model: nn.Module, reference: nn.Module) -> tuple[float, torch.optim.Optimizer]:
    """STEPS of Adam on both; the largest parameter difference at the end."""
    plain = torch.optim.Adam(reference.parameters(), lr=0.01, eps=1e-3)
    sharded = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    for step in range(STEPS):
        x, y = _data(step)
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        sharded.zero_grad()
        nn.functional.mse_loss(model(_mine(x)).float(), _mine(y)).backward()
        sharded.step()
    return _difference(model, reference), sharded


def check_features() -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    out: dict = {}
    # Meta: before materialize a forward names the unit; after it, the one-process model exactly.
    with torch.device("meta"):
        model = Net()
    for block in model.blocks:
        td.fully_shard(block)
    td.fully_shard(model)
    out["unmaterialized"] = _error(lambda: model(torch.randn(2, 4, 3)))
    model.to_empty(device="cpu")  # FSDP2's habit: harmless (the shards are made anew)
    out["unmaterialized_to_empty"] = _error(lambda: model(torch.randn(2, 4, 3)))
    td.fsdp.materialize(model, seed=SEED)
    out["meta_init"] = _difference(model, _eager())
    # Each rank keeps its 1/N alone: no storage of the whole unit behind the shard.
    out["shards"] = {name: (unit.numel, unit.shard.untyped_storage().nbytes() // 4,
                            unit.shard.device.type) for name, unit in units(model)}
    out["meta_train"] = _train(model, _eager())[0]
    # CPU offload (FSDP2's policy object, torch's own class): shards and Adam's state on the host.
    model = _sharded(meta=True, offload_policy=TorchOffload())
    out["offload_train"], optimizer = _train(model, _eager())
    out["offload_devices"] = {t.device.type for p in model.parameters()
                              for t in (p, p.grad, *optimizer.state[p].values()) if t.dim()}
    # Mixed precision: a reduce dtype of its own (exact), bf16 compute (bf16's rounding).
    model = _sharded(meta=False, mp_policy=td.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float64))
    out["reduce_f64_train"] = _train(model, _eager())[0]
    for name, policy in (("bf16_f32", td.fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
                         ("bf16_bf16", TorchPolicy(param_dtype=torch.bfloat16))):
        model = _sharded(meta=False, mp_policy=policy)
        seen: list = []
        model.blocks[0].linear1.register_forward_hook(
            lambda m, a, o, seen=seen: seen.append((m.weight.dtype, a[0].dtype)))
        out[f"{name}_train"] = _train(model, _eager())[0]
        out[f"{name}_seen"] = set(seen)
        out[f"{name}_masters"] = {p.dtype for p in model.parameters()}
    # output_dtype casts the unit's outputs (the root's, here: the blocks' feed the root's head).
    model = _eager()
    for block in model.blocks:
        td.fully_shard(block, mp_policy=td.fsdp.MixedPrecisionPolicy(torch.bfloat16))
    td.fully_shard(model, mp_policy=td.fsdp.MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.float32))
    out["output_dtype"] = model(torch.randn(2, 4, 3)).dtype
    # HSDP, replicas x shards: every feature at once.
    mesh = td.mesh(dp=2, shard=td.size() // 2)
    model = _sharded(meta=True, mesh=mesh, offload_policy=td.fsdp.CPUOffloadPolicy(),
                     mp_policy=td.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float64))
    out["hsdp_shard"] = {name: (unit.numel, unit.shard.numel()) for name, unit in units(model)}
    out["hsdp_train"] = _train(model, _eager())[0]
    clip = _sharded(meta=False, mesh=mesh)
    reference = _eager()
    x, y = _data(0)
    nn.functional.mse_loss(clip(_mine(x)), _mine(y)).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    out["hsdp_norm"] = (td.clip_grad_norm_(clip, 1.0).item(),
                        nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item())
    # GradScaler: rank 0 alone sees inf; every rank of every replica skips the step.
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    optimizer = torch.optim.SGD(clip.parameters(), lr=0.1)
    before = td.fsdp.full_state_dict(clip)
    optimizer.zero_grad()
    x = torch.randn(2, 4, 3)
    if td.rank() == 0:
        x[0, 0, 0] = float("inf")
    scaler.scale(nn.functional.mse_loss(clip(x), torch.zeros(2, 4, 2))).backward()
    scaler.step(optimizer)
    scaler.update()
    after = td.fsdp.full_state_dict(clip)
    out["hsdp_skipped"] = (all(torch.equal(before[k], v) for k, v in after.items()), scaler.get_scale())
    out["checkpoint"] = _checkpoint(mesh)
    out["errors"] = _bad_inputs()
    return out


def _checkpoint(mesh) -> float:
    """Checkpointer round trip of an offloaded bf16 HSDP model into a fresh one built on meta,
    offloaded, bf16 and sharded over every rank (another layout)."""
    options = dict(offload_policy=td.fsdp.CPUOffloadPolicy(),
                   mp_policy=td.fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    model = _sharded(meta=True, mesh=mesh, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data(0)
    nn.functional.mse_loss(model(_mine(x)).float(), _mine(y)).backward()
    optimizer.step()
    made = tempfile.mkdtemp(prefix="tandem-fsdp-memory-") if td.rank() == 0 else None
    directory = td.broadcast_object(made)
    td.Checkpointer(directory).save(1, model=model, optimizer=optimizer)
    with torch.device("meta"):
        fresh = Net()
    for block in fresh.blocks:
        td.fully_shard(block, **options)
    td.fully_shard(fresh, **options)
    td.fsdp.materialize(fresh, seed=SEED + 3)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    assert td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_optimizer) == 2
    before, after = td.fsdp.full_state_dict(model), td.fsdp.full_state_dict(fresh)
    states = [td.fsdp.full_optimizer_state_dict(m, o)
              for m, o in ((model, optimizer), (fresh, fresh_optimizer))]
    difference = max((before[k] - after[k]).abs().max().item() for k in before)
    for name, entry in states[0]["state"].items():
        for key, value in entry.items():
            difference = max(difference, (torch.as_tensor(value) - torch.as_tensor(
                states[1]["state"][name][key])).abs().max().item())
    td.barrier()
    if td.rank() == 0:
        shutil.rmtree(directory)
    return difference


class _Positional(nn.Module):
    """Draws its parameter in __init__, with no reset_parameters(): not replayable."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 3))
        self.proj = nn.Linear(3, 3)

    def forward(self, x):
        return self.proj(x + self.table)


def _error(call) -> str | None:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return str(error)
    return None


def _bad_inputs() -> dict:
    errors = {}
    with torch.device("meta"):
        model = nn.Sequential(_Positional(), nn.Linear(3, 2))
    td.fully_shard(model[0])
    td.fully_shard(model)
    errors["no_init"] = _error(lambda: td.fsdp.materialize(model, seed=0))
    # An init that forgets a parameter is named, with the unit.
    errors["unset"] = _error(lambda: td.fsdp.materialize(
        model, lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None, seed=0))
    with torch.device("meta"):
        model = nn.Sequential(_Positional(), nn.Linear(3, 2))
    td.fully_shard(model[0])
    td.fully_shard(model)

    def init(module):  # what the error asks for: it works
        if isinstance(module, _Positional):
            nn.init.normal_(module.table)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    td.fsdp.materialize(model, init, seed=0)
    errors["init_fn_works"] = tuple(model(torch.randn(4, 3)).shape)
    errors["nothing_meta"] = _error(lambda: td.fsdp.materialize(nn.Linear(2, 2)))
    errors["float8"] = _error(lambda: td.fully_shard(
        nn.Linear(2, 2), mp_policy=td.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float8_e4m3fn)))
    errors["both"] = _error(lambda: td.fully_shard(
        nn.Linear(2, 2), param_dtype=torch.bfloat16, mp_policy=td.fsdp.MixedPrecisionPolicy()))
    errors["offload_type"] = _error(lambda: td.fully_shard(nn.Linear(2, 2), offload_policy="cpu"))
    errors["mesh_tp"] = _error(lambda: td.fully_shard(nn.Linear(2, 2), mesh=td.mesh(tp=td.size())))
    errors["mesh_and_group"] = _error(lambda: td.fully_shard(nn.Linear(2, 2), group=object(),
                                                             mesh=object()))
    return errors


def _assert_results(results, world_size: int, backend: str = "gloo"):
    for rank, r in enumerate(results):
        assert "meta device" in r["unmaterialized"] and "Sequential" not in r["unmaterialized"], r
        assert r["unmaterialized_to_empty"] == r["unmaterialized"], r["unmaterialized_to_empty"]
        assert "td.fsdp.materialize" in r["unmaterialized"] and "Net" in r["unmaterialized"], r
        assert r["meta_init"] == 0.0, (rank, r["meta_init"])  # exactly the eager model's values
        for name, (numel, shard, device) in r["shards"].items():
            assert shard == -(-numel // world_size) and device == "cpu", (rank, name, numel, shard)
        for case in ("meta_train", "offload_train", "reduce_f64_train"):
            assert r[case] < 1e-5, (rank, case, r[case])
        assert r["offload_devices"] == {"cpu"}, r["offload_devices"]
        for case in ("bf16_f32", "bf16_bf16"):  # bf16 compute: its rounding, not a bug
            assert r[f"{case}_train"] < 1e-2, (rank, case, r[f"{case}_train"])
            assert r[f"{case}_seen"] == {(torch.bfloat16, torch.bfloat16)}, r[f"{case}_seen"]
            assert r[f"{case}_masters"] == {torch.float32}, r[f"{case}_masters"]
        assert r["output_dtype"] == torch.float32
        for name, (numel, shard) in r["hsdp_shard"].items():  # sharded within a replica only
            assert shard == -(-numel // (world_size // 2)), (rank, name, numel, shard)
        assert r["hsdp_train"] < 1e-5, (rank, r["hsdp_train"])
        norm, reference = r["hsdp_norm"]
        assert abs(norm - reference) < 1e-5 * reference, r["hsdp_norm"]
        assert r["hsdp_skipped"] == (True, 2.0), r["hsdp_skipped"]
        assert r["checkpoint"] == 0.0, (rank, r["checkpoint"])
        e = r["errors"]
        assert "module '0' (_Positional)" in e["no_init"] and "unit _Positional '0'" in e["no_init"], e
        assert "reset_parameters" in e["no_init"] and "init=fn" in e["no_init"], e["no_init"]
        assert "unit _Positional '0'" in e["unset"] and "table [4, 3]" in e["unset"], e["unset"]
        assert e["init_fn_works"] == (4, 2), e
        assert "nothing in this model was built on the meta device" in e["nothing_meta"], e
        assert f"the {backend} backend cannot reduce torch.float8_e4m3fn" in e["float8"], e["float8"]
        assert "torch.bfloat16" in e["float8"] and "torch.float32" in e["float8"], e["float8"]
        assert "both param_dtype= and mp_policy=" in e["both"], e["both"]
        assert "td.fsdp.CPUOffloadPolicy()" in e["offload_type"], e["offload_type"]
        assert "both group= and mesh=" in e["mesh_and_group"], e["mesh_and_group"]
        assert f"tp={world_size}" in e["mesh_tp"] and "group=mesh.dp_group" in e["mesh_tp"], e["mesh_tp"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_features_match_one_process(world_size):
    _assert_results(run_distributed(check_features, world_size=world_size, timeout=240), world_size)


@pytest.mark.timeout(300)
def test_memory_features_on_mpi():
    pytest.importorskip("mpi4py")
    _assert_results(run_distributed(check_features, world_size=2, backend="mpi", timeout=240), 2,
                    backend="mpi")


def test_policies_take_fsdp2_objects_and_refuse_what_no_backend_reduces():
    """Process-free: the policy checks run before anything communicates."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import OffloadPolicy

    from tandem.parallel.fully_shard import policies

    ported = policies.mixed_precision(TorchPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
                                      None, "gloo")
    assert ported == td.fsdp.MixedPrecisionPolicy(torch.bfloat16, None, torch.float32, True)
    # The older param_dtype= alone: fp32 reduction (the shards' dtype), no input casts.
    assert policies.mixed_precision(None, torch.float16, "mpi") == td.fsdp.MixedPrecisionPolicy(
        torch.float16, cast_forward_inputs=False)
    assert policies.offload(TorchOffload(pin_memory=False)) == td.fsdp.CPUOffloadPolicy(pin_memory=False)
    assert policies.offload(OffloadPolicy()) is None and policies.offload(None) is None
    assert policies.offload(None, "cpu") == td.fsdp.CPUOffloadPolicy()  # offload="cpu"
    with pytest.raises(ValueError, match='the one place to offload to is "cpu"'):
        policies.offload(None, "gpu")
    with pytest.raises(ValueError, match='give offload="cpu" or offload_policy=, not both'):
        policies.offload(td.fsdp.CPUOffloadPolicy(), "cpu")
    with pytest.raises(ValueError, match="the mpi backend cannot gather torch.float8_e5m2"):
        policies.mixed_precision(td.fsdp.MixedPrecisionPolicy(param_dtype=torch.float8_e5m2), None, "mpi")
    with pytest.raises(ValueError, match="reduce_dtype=torch.int32: give a floating torch dtype"):
        policies.mixed_precision(td.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.int32), None, "gloo")
    with pytest.raises(TypeError, match="is not a MixedPrecisionPolicy"):
        policies.mixed_precision(torch.bfloat16, None, "gloo")
    cast = policies.cast_floating(((torch.ones(2), torch.ones(2, dtype=torch.long)), {"m": torch.ones(1)}),
                                  torch.bfloat16)
    assert [t.dtype for t in (*cast[0], cast[1]["m"])] == [torch.bfloat16, torch.long, torch.bfloat16]
