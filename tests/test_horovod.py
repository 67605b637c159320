"""`tandem.horovod` keeps Horovod's names and semantics, across real processes."""

import torch

import tandem.horovod as hvd
from tandem.testing import run_distributed


def check_horovod_collectives():
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (me, n, 0, 1)
    mine = torch.tensor([float(me), 10.0])
    mean = (n - 1) / 2

    assert hvd.allreduce(mine).tolist() == [mean, 10.0]  # Average is the default
    assert hvd.allreduce(mine, op=hvd.Sum).tolist() == [sum(range(n)), 10.0 * n]
    assert hvd.allreduce(mine, average=False).tolist() == [sum(range(n)), 10.0 * n]
    assert hvd.allreduce(mine, compression=hvd.Compression.fp16).dtype == torch.float32
    scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert scaled.tolist() == [sum(range(n)), 10.0 * n]
    assert mine.tolist() == [float(me), 10.0]  # out-of-place calls leave the input alone

    inplace = mine.clone()
    hvd.allreduce_(inplace)
    assert inplace.tolist() == [mean, 10.0]
    handle = hvd.allreduce_async(mine, op=hvd.Max)
    assert hvd.synchronize(handle).tolist() == [n - 1.0, 10.0] and hvd.poll(handle)
    handle = hvd.allreduce_async_(mine.clone(), op=hvd.Sum, postscale_factor=2.0)
    assert hvd.synchronize(handle).tolist() == [2.0 * sum(range(n)), 20.0 * n]

    assert [t.tolist() for t in hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)] == [
        [sum(range(n)), 10.0 * n], [2.0 * sum(range(n)), 20.0 * n]]
    assert hvd.allgather(torch.full((me + 1,), float(me))).tolist() == [
        float(r) for r in range(n) for _ in range(r + 1)]
    root = n - 1
    assert hvd.broadcast(mine, root_rank=root).tolist() == [float(root), 10.0]
    into = mine.clone()
    hvd.broadcast_(into, root_rank=root)
    assert into.tolist() == [float(root), 10.0]

    rows = torch.arange(2 * n, dtype=torch.float32) + 100 * me
    output, received = hvd.alltoall(rows)
    assert received.tolist() == [2] * n
    assert output.tolist() == [100.0 * r + 2 * me + k for r in range(n) for k in range(2)]
    reduced = hvd.reducescatter(torch.ones(2 * n) * (me + 1))
    assert reduced.tolist() == [(n + 1) / 2] * 2

    assert hvd.broadcast_object({"me": me}, root_rank=root) == {"me": root}
    assert hvd.allgather_object(me) == list(range(n))
    hvd.barrier()


def test_horovod_collectives():
    run_distributed(check_horovod_collectives, world_size=2)
    run_distributed(check_horovod_collectives, world_size=3)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator)


def check_horovod_training_script():
    """A typical horovod.torch script, unchanged but for the import, equals one process."""
    hvd.init()
    model = _model(seed=hvd.rank())  # different starts: broadcast fixes them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, op=hvd.Sum)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = _model(seed=0)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    n, me = hvd.size(), hvd.rank()
    for step in range(5):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for half in range(2):  # backward_passes_per_step=2: reduce once per two passes
            x, y = _batch(10 * step + half, rows=4 * n)
            shard = slice(4 * me, 4 * me + 4)
            # op=Sum of per-rank means: scale each rank's loss by 1/n to get the global mean.
            (torch.nn.functional.mse_loss(model(x[shard]), y[shard]) / n).backward()
            torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        ref_optimizer.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6), name

    # hvd.join(): the last rank runs out of data one step after the others, which answer its
    # reductions from join() until it joins too; every rank learns who was last.
    if me == n - 1:
        for half in range(2):
            x, y = _batch(100 + half, rows=4)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert hvd.join() == n - 1

    # hvd.SyncBatchNorm: the statistics of the whole batch, as one process would compute them.
    # float32 sums in a different order, and the variance as E[x^2] - E[x]^2: ~1e-6 apart.
    torch.manual_seed(0)
    full = torch.randn(4 * n, 3) * 3 + 1
    sync_bn, plain_bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    out = sync_bn(full[4 * me : 4 * me + 4])
    expected = plain_bn(full)[4 * me : 4 * me + 4]
    assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()
    assert torch.allclose(sync_bn.running_mean, plain_bn.running_mean, atol=1e-6)
    assert torch.allclose(sync_bn.running_var, plain_bn.running_var, atol=1e-5)


def test_horovod_training_script_matches_one_process():
    run_distributed(check_horovod_training_script, world_size=2)
