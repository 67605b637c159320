"""Uneven shards give one process's result: gradients weighted by samples (seed 003's m_k / n).

100 samples on 3 ranks without padding are shards of 34/33/33, and the epoch's last step holds
4/3/3 samples; a loader tandem did not make may end an epoch with a short batch on one rank.
One process averages its loss over all n samples of the step, so the ranks' gradients must
be weighted m_k / n, not 1/k. Each check trains one process on the same samples in the same
order next to the distributed model and returns the largest parameter difference. The
sampler's counts are pure functions, tested without processes.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tandem as td
from tandem import runtime
from tandem.data import ShardSampler, epoch_order
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]
SMALL_BUCKETS = {"bucket_mb": 2 / 1024, "first_bucket_mb": 0.5 / 1024}  # several buckets
TOL = 1e-6


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def data(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item()
               for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def wrap(model, wrapper):
    """(the model to call, the optimizer to step) for `wrapper`."""
    if wrapper == "ddp":
        net = td.DistributedDataParallel(model, **SMALL_BUCKETS)
        return net, sgd(net.parameters())
    return model, td.DistributedOptimizer(sgd(model.parameters()), **SMALL_BUCKETS)


def one_process_step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


# -- the sampler's counts, without processes ------------------------------------------------


def test_unpadded_shards_read_every_sample_once_and_report_the_last_step_as_uneven():
    samplers = [ShardSampler(100, r, 3, batch_size=30, pad=False) for r in range(3)]
    shards = [list(s) for s in samplers]
    assert [len(s) for s in shards] == [34, 33, 33]
    assert sorted(i for s in shards for i in s) == list(range(100))
    # Steps of 30 (10 per rank) and a last one of 10 samples: 4/3/3.
    assert [[s.step_samples(j) for j in range(4)] for s in samplers] == [
        [(10, False)] * 3 + [(4, True)], [(10, False)] * 3 + [(3, True)],
        [(10, False)] * 3 + [(3, True)]]
    # The default pads (each rank 34 samples): no step is uneven, nothing is weighted.
    padded = ShardSampler(100, 2, 3, batch_size=30)
    assert len(padded) == 34 and padded.step_samples(3) == (4, False)


# -- training against one process ------------------------------------------------------------


def check_partitioned(wrapper, epochs=2):
    """td.partition_dataset(pad=False): 100 samples, global batch 30, on 3 ranks."""
    n, batch = 100, 30
    x, y = data(n)
    loader, per_rank = td.partition_dataset(TensorDataset(x, y), batch_size=batch, pad=False, seed=3)
    reference, model = mlp(), mlp()
    ref_opt = sgd(reference.parameters())
    net, opt = wrap(model, wrapper)
    sizes = []
    for epoch in range(epochs):
        order = torch.as_tensor(epoch_order(n, epoch, seed=3))
        for start in range(0, n, batch):  # one process: the same batches of the same order
            rows = order[start:start + batch]
            one_process_step(reference, ref_opt, x[rows], y[rows])
        loader.set_epoch(epoch)  # (the evaluation pass below advanced it too)
        for xb, yb in loader:
            sizes.append(len(xb))
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
        with torch.no_grad():  # an evaluation pass: its batches are not counted
            for xb, _ in loader:
                net(xb)
    moved = max_diff(model, mlp())
    return per_rank, sizes, max_diff(model, reference), moved


def check_explicit(wrapper):
    """A torch DataLoader per rank over shards of 64/64/36 samples, batch 32: the second step
    is 32/32/4. `td.samples(len(x))` says each batch's size."""
    rank, k = td.rank(), td.size()
    shards = [64, 64, 36][:k]
    x, y = data(sum(shards), seed=11)
    starts = [sum(shards[:r]) for r in range(k)]
    mine = slice(starts[rank], starts[rank] + shards[rank])
    loader = DataLoader(TensorDataset(x[mine], y[mine]), batch_size=32)
    reference, model = mlp(), mlp()
    ref_opt = sgd(reference.parameters())
    for step in range(2):  # one process: the union of the ranks' step-th batches
        rows = torch.cat([torch.arange(s + 32 * step, min(s + 32 * (step + 1), s + m))
                          for s, m in zip(starts, shards, strict=True)])
        one_process_step(reference, ref_opt, x[rows], y[rows])
    net, opt = wrap(model, wrapper)
    for xb, yb in loader:
        td.samples(len(xb))
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
    return max_diff(model, reference)


def check_join():
    """61 samples, global batch 30: the last step has 1 sample, on rank 0 alone; the others,
    out of data, answer it inside td.join, and the step is that one sample's gradient."""
    n, batch = 61, 30
    x, y = data(n, seed=5)
    loader, _ = td.partition_dataset(TensorDataset(x, y), batch_size=batch, pad=False)
    reference, model = mlp(), mlp()
    ref_opt = sgd(reference.parameters())
    order = torch.as_tensor(epoch_order(n, 0))
    for start in range(0, n, batch):
        rows = order[start:start + batch]
        one_process_step(reference, ref_opt, x[rows], y[rows])
    opt = td.DistributedOptimizer(sgd(model.parameters()), **SMALL_BUCKETS)
    sizes = []
    with td.join(opt):
        for xb, yb in loader:
            sizes.append(len(xb))
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    return sizes, max_diff(model, reference)


def check_one_rank_weights_alone():
    model = mlp()
    opt = td.DistributedOptimizer(sgd(model.parameters()))
    x, y = data(4)
    step = -1
    try:
        for step in range(3):
            if td.rank() == 0 and step == 1:
                td.samples(4)  # this rank alone weights its step
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    except td.DivergedError as error:
        return step, str(error)
    return step, None


def check_costs():
    """Operations issued and host reads of an even step and of a weighted one: the same."""
    from test_hot_paths import HostReads

    model = mlp()
    opt = td.DistributedOptimizer(sgd(model.parameters()), **SMALL_BUCKETS)
    x, y = data(12)
    watchdog = runtime.get_backend().watchdog

    def step(weight=None):
        if weight is not None:
            td.samples(weight)
        before = sum(watchdog._issued.values())
        with HostReads() as reads:
            opt.zero_grad()
            F.cross_entropy(model(x[: weight or 4]), y[: weight or 4]).backward()
            opt.step()
        return sum(watchdog._issued.values()) - before, reads.seen

    step()  # the first round also checksums the weights
    return step(), step(4 - td.rank())


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_shards_train_like_one_process(backend):
    for wrapper in ("optimizer", "ddp"):
        results = run_distributed(check_partitioned, 3, backend, args=(wrapper,), timeout=150)
        for rank, (per_rank, sizes, diff, moved) in enumerate(results):
            assert per_rank == 10
            assert sizes == [10, 10, 10, 4 if rank == 0 else 3] * 2, sizes
            assert diff < TOL and moved > 1e-2, (wrapper, rank, diff, moved)
        for rank, diff in enumerate(run_distributed(check_explicit, 3, backend, args=(wrapper,))):
            assert diff < TOL, (wrapper, rank, diff)
    for rank, (sizes, diff) in enumerate(run_distributed(check_join, 3, backend)):
        assert sizes == ([10, 10, 1] if rank == 0 else [10, 10]), sizes
        assert diff < TOL, (rank, diff)


def test_a_weighted_step_costs_no_operation_and_no_host_read_more():
    for even, weighted in run_distributed(check_costs, 3):
        # The step's agreement and one all-reduce per bucket, both times; its agreement is the
        # only host read.
        assert even == weighted, (even, weighted)
        assert even[1] == ["tolist"], even


def test_a_rank_that_weights_a_step_alone_is_named():
    for step, message in run_distributed(check_one_rank_weights_alone, 3):
        assert step == 1 and message is not None, (step, message)
        assert "rank 0: gradient reduction #2 of DistributedOptimizer (after 1 optimizer steps), " \
               "weighted by its samples" in message, message
        assert "rank 1: gradient reduction #2 of DistributedOptimizer (after 1 optimizer steps)\n" \
            in message, message
