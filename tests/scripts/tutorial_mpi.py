"""The programs of PyTorch's "Writing Distributed Applications" tutorial, as written there, on
`backend='mpi'` (stock pip PyTorch has none; `import tandem` gives it one over mpi4py). The
only other line that differs is `import tandem`. Run: `tandem run -np 2 tutorial_mpi.py` or
`mpiexec -n 2 python tutorial_mpi.py`."""

import os

import torch
import torch.distributed as dist

import tandem  # noqa: F401  (the line that makes backend='mpi' work)


def ping(rank, size):
    """Blocking point-to-point communication."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0])
    return tensor[0].item()


def all_reduce(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])
    return tensor[0].item()


def sync_gradients(model):
    """ Gradient averaging. """
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def train(rank, size):
    torch.manual_seed(1234)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(data).pow(2).mean()
        loss.backward()
        sync_gradients(model)
        optimizer.step()
    weights = model.weight.detach().clone()
    everyone = [torch.empty_like(weights) for _ in range(size)]
    dist.all_gather(everyone, weights)
    assert all(torch.equal(w, weights) for w in everyone), "the replicas diverged"
    print('Rank ', rank, ' replicas agree: ', weights.sum().item())


def run(rank, size):
    assert ping(rank, size) == 1.0
    assert all_reduce(rank, size) == 2.0
    train(rank, size)


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = '29500'
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    init_process(0, 0, run, backend='mpi')
