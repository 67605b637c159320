"""torch's own higher-level APIs on tandem's backends "tandem"/"mpi", as on torch's Gloo.

In the harness's MPI worlds `td.init()` made torch's default group tandem's (backend "tandem"
over the MPI engine); in its Gloo worlds it is torch's own Gloo group. The same function runs
in both and the results must be equal to the bit: 2-D device meshes (FSDP2 + tensor parallel
at 1x2, 2x1 and 2x2; HSDP at 2x2), DCP's state-dict helpers with full_state_dict,
broadcast_from_rank0 and cpu_offload, Lightning Fabric's `rank_zero_first` (a monitored
barrier on a sub-group with a 10,000-day timeout).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.testing import mpiexec_command, run_distributed

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    not HAVE_MPI, reason="the MPI engine needs mpi4py"))]
STEPS = 3
JOB_TIMEOUT_S = 150


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)


def _train(model: nn.Module, optimizer, index: int, steps: int = STEPS) -> None:
    inputs, targets = _batch(index)
    for _ in range(steps):
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


def _sent(model: nn.Module) -> dict[str, list]:
    """The full parameters as the harness sends them back (plain floats: exact for float32)."""
    return {name: value.tolist() for name, value in _full(model).items()}


def shapes(size: int) -> list[tuple[int, int]]:
    return [(1, 2), (2, 1)] if size == 2 else [(2, 2)]


def train_fsdp_tp(shape: tuple[int, int]) -> dict[str, list]:
    """torch's FSDP2 over tensor parallelism on a 2-D mesh ("dp", "tp") of `shape`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = _mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01), mesh["dp"].get_local_rank())
    return _sent(model)


def train_hsdp() -> dict[str, list]:
    """torch's HSDP: FSDP2 on a 2x2 mesh, replicated across "replicate", sharded across "shard"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01), dist.get_rank())
    return _sent(model)


def _same(a, b, where: str = "") -> None:
    """`a` and `b` (nested dicts/lists of tensors and numbers) equal to the bit."""
    if isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def dcp_round_trip() -> dict[str, list]:
    """DCP's get_/set_model_state_dict and get_/set_optimizer_state_dict on torch's FSDP2:
    full state dicts (on CPU, rank 0 only) into a fresh model and optimizer by
    broadcast_from_rank0; both read back equal to the bit, and train on as the original."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()

    def sharded(seed: int):
        model = _mlp(seed)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, optimizer = sharded(0)
    _train(model, optimizer, rank)
    read = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=read)
    state = get_optimizer_state_dict(model, optimizer, options=read)
    assert bool(weights) == (rank == 0), f"rank {rank}: cpu_offload keeps the full state on 0 only"

    fresh, fresh_optimizer = sharded(1)
    write = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (torch's broadcast_from_rank0 puts the loaded tensors into the dict it is given)
    set_model_state_dict(fresh, copy.deepcopy(weights), options=write)
    set_optimizer_state_dict(fresh, fresh_optimizer, copy.deepcopy(state), options=write)
    weights_again = get_model_state_dict(fresh, options=read)  # collectives: every rank
    state_again = get_optimizer_state_dict(fresh, fresh_optimizer, options=read)
    _same(weights_again, weights, "model")
    _same(state_again, state, "optimizer")
    _train(model, optimizer, rank, steps=1)
    _train(fresh, fresh_optimizer, rank, steps=1)
    _same(_full(fresh), _full(model), "after one more step")
    return _sent(fresh)


def fabric_rank_zero_first(marker: str) -> int:
    """Fabric(strategy="tandem")'s rank_zero_first: the others enter after rank 0 has left."""
    from pathlib import Path

    from lightning.fabric import Fabric

    fabric = Fabric(strategy="tandem", accelerator="cpu")
    fabric.launch()
    with fabric.rank_zero_first():
        if fabric.global_rank == 0:
            Path(marker).write_text("rank 0 was here")
        else:
            assert Path(marker).exists(), f"rank {fabric.global_rank} entered before rank 0 left"
    return fabric.global_rank


# --- the tests ----------------------------------------------------------------------------------
# torch's Gloo is the reference: each case runs there, then on tandem's MPI engine, and the two
# must agree to the bit (every reduction here is over two ranks, so the order cannot differ).


def _on_both(fn, size: int, args=()) -> list:
    gloo = run_distributed(fn, size, args=args, backend="gloo")
    if not HAVE_MPI:
        pytest.skip("the MPI engine needs mpi4py (Gloo's run passed)")
    mpi = run_distributed(fn, size, args=args, backend="mpi")
    _same(mpi, gloo, f"{fn.__name__}{args} on MPI against Gloo")
    return mpi


@pytest.mark.parametrize("shape", shapes(2), ids=["1x2", "2x1"])
def test_fsdp_with_tensor_parallel_on_a_2d_mesh_equals_gloo(shape):
    results = _on_both(train_fsdp_tp, 2, (shape,))
    _same(results[0], results[1], "rank 0 and rank 1")


def test_fsdp_with_tensor_parallel_on_a_2x2_mesh_equals_gloo():
    results = _on_both(train_fsdp_tp, 4, ((2, 2),))
    _same(results[0], results[3], "rank 0 and rank 3")


def test_hsdp_on_a_2x2_mesh_equals_gloo():
    results = _on_both(train_hsdp, 4)
    _same(results[0], results[3], "rank 0 and rank 3")


def test_dcp_full_state_dicts_broadcast_from_rank0_round_trip_as_on_gloo():
    _on_both(dcp_round_trip, 2)


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_fabric_rank_zero_first_lets_rank_0_go_first(backend, tmp_path):
    marker = str(tmp_path / "rank0")
    assert run_distributed(fabric_rank_zero_first, 2, args=(marker,), backend=backend) == [0, 1]


# --- init_process_group("mpi") / ("tandem") with no `import tandem`: torch's autoloading ----------

NO_IMPORT = """
import sys
import torch
import torch.distributed as dist
loaded = sorted(m for m in sys.modules if m.startswith("tandem.") and not m.startswith("tandem.hooks"))
assert not loaded, f"import torch loaded tandem's {loaded} before any use"
dist.init_process_group(sys.argv[1])
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
# one write of the whole line: print() writes each word on its own when stdout is unbuffered,
# and the two ranks' words then interleave on the one pipe
sys.stdout.write(f"rank {dist.get_rank()} {dist.get_backend()} "
                 f"{type(dist.group.WORLD).__name__} {t.tolist()}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def _no_tandem_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("TANDEM_", "PMI_", "OMPI_")) and k not in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}


def test_import_torch_alone_names_the_backends_and_loads_nothing_else():
    code = ("import sys, torch, torch.distributed as dist\n"
            "print('tandem' in dist.Backend.backend_list, dist.is_mpi_available(),\n"
            "      sorted(m for m in sys.modules if m.startswith('tandem.comm')))\n")
    done = subprocess.run([sys.executable, "-c", code], env=_no_tandem_env(), capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    # "mpi" waits for a group that asks for it outside an MPI launcher (hooks/torch_backends)
    assert done.stdout.split() == ["True", "False", "[]"], done.stdout
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**_no_tandem_env(), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                         timeout=JOB_TIMEOUT_S)
    assert off.stdout.split()[0] == "False", off.stdout + off.stderr


@pytest.mark.skipif(not HAVE_MPI, reason="the MPI engine needs mpi4py")
def test_init_process_group_mpi_without_import_tandem_under_mpiexec(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(NO_IMPORT)
    done = subprocess.run([*mpiexec_command(2), sys.executable, str(script), "mpi"],
                          env=_no_tandem_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    # two processes write to one pipe: count the whole results instead of matching lines
    assert done.stdout.count("mpi TandemProcessGroup [3.0, 3.0]") == 2, done.stdout


def test_init_process_group_tandem_without_import_tandem_under_tandem_run(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(NO_IMPORT)
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", "gloo",
                           str(script), "tandem"], env=_no_tandem_env(), capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("tandem TandemProcessGroup [3.0, 3.0]") == 2, done.stdout
