"""CUDA tensors and NCCL: the same contract on GPUs. Skipped, with the reason, without GPUs."""

import pytest
import torch
from test_collectives import CHECKS, check_seed_program

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


@requires_cuda
def test_data_parallel_on_the_gpu_through_gloo():
    run_distributed(check_data_parallel_on_the_gpu, world_size=2, backend="gloo")


@requires_two_gpus
def test_data_parallel_on_the_gpu_through_nccl():
    run_distributed(check_data_parallel_on_the_gpu, world_size=2, backend="nccl")
