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


def check_partition_dataset_places_batches():
    rank, device = td.init()
    data = torch.utils.data.TensorDataset(torch.randn(256, 4, dtype=torch.float64),
                                          torch.randint(0, 3, (256,)))
    loader, per_rank = td.partition_dataset(data, 128, device=device, dtype="float32")
    x, y = next(iter(loader))
    try:
        td.partition_dataset(data, 128, dtype="int8")
    except ValueError as error:
        refused = str(error)
    return per_rank, str(x.device), x.dtype == torch.float32, y.dtype == torch.int64, refused


def test_partition_dataset_delivers_batches_on_the_device_in_the_dtype():
    for per_rank, device, floats, labels, refused in run_distributed(
            check_partition_dataset_places_batches, 2):
        assert per_rank == 64 and device == "cpu" and floats and labels
        assert "dtype='int8': give a floating-point dtype" in refused
