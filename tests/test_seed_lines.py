"""The lines of the scripts tandem is written for run as they are written (issue 39, item 4):
`rank, device = td.init()`, `hvd.DistributedDataParallel(model)`."""

import pytest
import torch

import tandem as td
from tandem.testing import run_distributed


def check_init_unpacks_to_rank_and_device():
    rank, device = td.init()
    world = td.init()
    return rank == td.rank() == world.rank, device == td.device() == world.device


def test_rank_device_unpack_from_init():
    for same_rank, same_device in run_distributed(check_init_unpacks_to_rank_and_device, 2):
        assert same_rank and same_device


def check_hvd_distributed_data_parallel():
    import tandem.horovod as hvd

    hvd.init()
    torch.manual_seed(0)
    model = hvd.DistributedDataParallel(torch.nn.Linear(3, 1))
    x = torch.full((2, 3), float(hvd.rank() + 1))
    model(x).sum().backward()
    return model.module.weight.grad.tolist()


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_hvd_distributed_data_parallel_averages_gradients(backend):
    grads = run_distributed(check_hvd_distributed_data_parallel, 2, backend)
    assert grads[0] == grads[1] == [[3.0, 3.0, 3.0]]  # the mean of 2 x 1 and 2 x 2
