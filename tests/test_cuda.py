"""CUDA tensors and NCCL: the same contract on GPUs. Skipped, with the reason, without GPUs.

On one GPU, 2 and 3 ranks share it over Gloo and MPI (CUDA tensors staged through the host as
DESIGN §2 says), and NCCL runs a world of one (it refuses two ranks on one GPU); tests that need
a GPU per rank wait for a machine with two. `scripts/gpu-check.sh` runs this file, and
test_cuda_parallel.py, on a GPU machine (README, "GPU check").
"""

import pytest
import torch
from test_collectives import CHECKS, check_seed_program
from torch import nn

import tandem as td
from tandem.testing import run_distributed

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU, and none is visible on this machine"
)
requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL needs one GPU per rank; {torch.cuda.device_count()} GPU(s) visible, 2 needed",
)


def check_cuda_tensors_stay_on_their_device():
    """CUDA tensors in, CUDA tensors out, whatever engine carries them (staged for Gloo)."""
    device = td.device()
    assert device.type == "cuda"
    mine = torch.full((1000,), float(td.rank() + 1), device=device)
    total = td.allreduce(mine, op="sum")
    assert total.device == device and total.eq(sum(range(1, td.size() + 1))).all()
    gathered = td.allgather(mine[: td.rank() + 1])
    assert gathered.device == device and gathered.numel() == sum(range(1, td.size() + 1))
    assert td.broadcast(mine, root=td.size() - 1).eq(float(td.size())).all()
    inplace = mine.clone()
    td.allreduce(inplace, op="mean", inplace=True)
    assert inplace.eq((td.size() + 1) / 2).all()


@requires_cuda
def test_cuda_tensors_through_gloo():
    run_distributed(check_cuda_tensors_stay_on_their_device, world_size=2, backend="gloo")


@requires_two_gpus
def test_cuda_tensors_through_nccl():
    run_distributed(check_cuda_tensors_stay_on_their_device, world_size=2, backend="nccl")


@requires_two_gpus
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matrix_on_nccl(check):
    run_distributed(check, world_size=2, backend="nccl")


@requires_two_gpus
def test_seed_program_on_nccl():
    assert run_distributed(check_seed_program, world_size=2, backend="nccl") == [
        (None, 3.0), ([1.0, -1.0], 3.0)]


def check_data_parallel_on_the_gpu():
    """k ranks with batch B/k equal one process with batch B, with everything on the GPU."""
    device, n, me = td.device(), td.size(), td.rank()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 1)).to(device)

    mine, reference = model(), model()
    opt = td.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=mine.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(10):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * n, 8, generator=generator), torch.randn(8 * n, 1, generator=generator)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(mine(x[8 * me : 8 * me + 8]), y[8 * me : 8 * me + 8]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for a, b in zip(mine.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max().item()


SHARED_GPU = [pytest.param(backend, k, id=f"{backend}-{k}") for backend in ("gloo", "mpi") for k in (2, 3)]


def _skip_without_mpi(backend: str) -> None:
    if backend == "mpi":
        pytest.importorskip("mpi4py")


@requires_cuda
@pytest.mark.parametrize("backend, k", SHARED_GPU)
def test_data_parallel_on_one_shared_gpu(backend, k):
    _skip_without_mpi(backend)
    run_distributed(check_data_parallel_on_the_gpu, world_size=k, backend=backend)


@requires_cuda
def test_cuda_tensors_through_mpi():
    _skip_without_mpi("mpi")
    run_distributed(check_cuda_tensors_stay_on_their_device, world_size=2, backend="mpi")


@requires_cuda
def test_a_world_of_one_on_nccl():
    run_distributed(check_cuda_tensors_stay_on_their_device, world_size=1, backend="nccl")
    run_distributed(check_data_parallel_on_the_gpu, world_size=1, backend="nccl")


def check_data_parallel_on_a_side_stream():
    """The same equivalence with every kernel queued on a stream that is not the default one:
    the reducer's copies into its buckets and the engines' reductions must order themselves
    after the stream the gradients were computed on."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() != torch.cuda.default_stream()
        check_data_parallel_on_the_gpu()
    torch.cuda.current_stream().wait_stream(side)


@requires_cuda
@pytest.mark.parametrize("backend, k", [("gloo", 2), ("mpi", 2), ("nccl", 1)],
                         ids=["gloo-2", "mpi-2", "nccl-1"])
def test_reducer_on_a_side_stream(backend, k):
    _skip_without_mpi(backend)
    run_distributed(check_data_parallel_on_a_side_stream, world_size=k, backend=backend)


def check_no_host_sync_in_a_step(wrapper: str) -> None:
    """`set_sync_debug_mode("error")` around training steps: tandem's hot path (the reducer,
    the optimizer's step) queues its work and never waits for the GPU on the host."""
    device = td.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    if wrapper == "ddp":
        model = td.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                      named_parameters=model.named_parameters())
    x, y = torch.randn(16, 64, device=device), torch.randn(16, 1, device=device)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(3):  # the first rounds agree on the layout once (that may wait)
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:  # the mode is armed: a sync made on purpose is refused
            torch.ones(1, device=device).item()
            armed = False
        except RuntimeError:
            armed = True
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert armed, "set_sync_debug_mode('error') let .item() through: this check would prove nothing"
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


@requires_cuda
@pytest.mark.parametrize("wrapper", ["optimizer", "ddp"])
def test_no_host_sync_on_the_hot_path(wrapper):
    # NCCL only: through Gloo and MPI, CUDA tensors travel through host memory, which waits
    # for the GPU by construction (the contract's staging), so a sync there is no defect.
    run_distributed(check_no_host_sync_in_a_step, world_size=1, backend="nccl", args=(wrapper,))


@requires_two_gpus
def test_data_parallel_on_the_gpu_through_nccl():
    run_distributed(check_data_parallel_on_the_gpu, world_size=2, backend="nccl")
