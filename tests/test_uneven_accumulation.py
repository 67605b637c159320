"""Uneven batches with gradient accumulation give one process's result (issue 40, item 5).

One process following torch's accumulation recipe runs each micro-batch of a window (the union
of the ranks' micro-batches) and divides its mean loss by the window's number of micro-batches
M: every micro-batch counts alike, whatever its size. So rank k's part of micro-batch j must be
weighted m_kj / n_j, by micro-batch. 100 samples on 3 ranks, global batch 30, without padding:
an epoch's micro-batches are 30, 30, 30 and 10 (4/3/3), and the windows below put the short
one first, last and in windows of 2 and 3. Each check trains one process next to the
distributed model on the same samples in the same order and returns the largest difference.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_uneven_shards import BACKENDS, TOL, data, mlp  # the same model, data and tolerance
from torch.utils.data import DataLoader, TensorDataset

import tandem as td
from tandem.data import epoch_order
from tandem.testing import run_distributed

N, BATCH = 100, 30
WINDOWS = [3, 3, 2]  # micro-batches per step over 2 epochs of 4: (30 30 30) (10 30 30) (30 10)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def windows():
    """(micro-batch index, the window's length, whether it ends the window) in order."""
    j = 0
    for m in WINDOWS:
        for i in range(m):
            yield j, m, i == m - 1
            j += 1


def one_process(x, y, micro_rows):
    """torch's recipe on one process: each micro-batch's mean loss / M, one step per window."""
    model = mlp()
    opt = sgd(model.parameters())
    for j, m, last in windows():
        (F.cross_entropy(model(x[micro_rows[j]]), y[micro_rows[j]]) / m).backward()
        if last:
            opt.step()
            opt.zero_grad()
    return model


def max_diff(state, reference):
    return max((state[k].double() - v.double()).abs().max().item()
               for k, v in reference.state_dict().items())


def wrapped(wrapper):
    """(the model, the optimizer, a context for the micro-batches that do not end a window)."""
    model = mlp()
    if wrapper == "ZeroOptimizer":  # reduces at step(): accumulates without a switch
        return model, td.ZeroOptimizer(sgd(model.parameters())), contextlib.nullcontext
    if wrapper == "DistributedOptimizer":
        return model, td.DistributedOptimizer(sgd(model.parameters())), lambda: td.no_sync(model)
    td.fully_shard(model)
    if wrapper == "fully_shard no_sync":
        return model, sgd(model.parameters()), lambda: td.no_sync(model)
    return model, sgd(model.parameters()), contextlib.nullcontext


def train(model, opt, local, batches):
    """The distributed loop: the same recipe on each rank's micro-batches."""
    sizes = []
    for (_, m, last), (xb, yb) in zip(windows(), batches, strict=True):
        sizes.append(len(xb))
        with contextlib.nullcontext() if last else local():
            (F.cross_entropy(model(xb), yb) / m).backward()
        if last:
            opt.step()
            opt.zero_grad()
    return sizes


def check_partitioned(wrapper):
    """td.partition_dataset(pad=False): the loader knows each micro-batch's global size."""
    x, y = data(N)
    loader, _ = td.partition_dataset(TensorDataset(x, y), batch_size=BATCH, pad=False, seed=3)
    micro_rows = []
    for epoch in range(2):
        order = torch.as_tensor(epoch_order(N, epoch, seed=3))
        micro_rows += [order[s:s + BATCH] for s in range(0, N, BATCH)]
    reference = one_process(x, y, micro_rows)
    model, opt, local = wrapped(wrapper)

    def batches():  # read as the loop goes: each batch is reported before its backward
        for epoch in range(2):
            loader.set_epoch(epoch)
            yield from loader

    sizes = train(model, opt, local, batches())
    return sizes, max_diff(td.fsdp.full_state_dict(model), reference)


def check_explicit(total):
    """A torch DataLoader per rank over shards of 64/64/36 samples, batch 32, one window of its
    two micro-batches: 32/32/32 (96 in all), then 32/32/4 (68). `td.samples(len(x), total=...)`
    says each micro-batch's size; without `total` the window's sizes are unknown."""
    rank = td.rank()
    shards = [64, 64, 36]
    x, y = data(sum(shards), seed=11)
    starts = [sum(shards[:r]) for r in range(3)]
    loader = DataLoader(TensorDataset(x[starts[rank]:starts[rank] + shards[rank]],
                                      y[starts[rank]:starts[rank] + shards[rank]]), batch_size=32)
    micro_rows = [torch.cat([torch.arange(s + 32 * j, min(s + 32 * (j + 1), s + m))
                             for s, m in zip(starts, shards, strict=True)]) for j in range(2)]
    reference = mlp()
    opt = sgd(reference.parameters())
    for rows in micro_rows:  # torch's recipe on one process
        (F.cross_entropy(reference(x[rows]), y[rows]) / 2).backward()
    opt.step()
    model = mlp()
    opt = td.ZeroOptimizer(sgd(model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows, (xb, yb) in zip(micro_rows, loader, strict=True):
            td.samples(len(xb), total=len(rows) if total else None)
            (F.cross_entropy(model(xb), yb) / 2).backward()
        opt.step()
    said = [str(w.message) for w in caught if "td.samples" in str(w.message)]
    return max_diff(model.state_dict(), reference), said


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulated_uneven_micro_batches_train_like_one_process(backend):
    for wrapper in ("ZeroOptimizer", "fully_shard", "fully_shard no_sync"):
        for rank, (sizes, diff) in enumerate(
                run_distributed(check_partitioned, 3, backend, args=(wrapper,))):
            assert sizes == [10, 10, 10, 4 if rank == 0 else 3] * 2, sizes
            assert diff < TOL, (wrapper, rank, diff)
    for rank, (diff, said) in enumerate(run_distributed(check_explicit, 3, backend, args=(True,))):
        assert diff < TOL and not said, (rank, diff, said)


def test_counts_without_their_global_sizes_warn_on_the_rank_whose_micro_batches_differ():
    for rank, (diff, said) in enumerate(run_distributed(check_explicit, 3, "gloo", args=(False,))):
        if rank < 2:  # 32 and 32: nothing differs here
            assert not said, said
        else:  # 32 then 4: the window mean, not torch's recipe
            assert len(said) == 1 and "[4.0, 32.0]" in said[0] and "total=" in said[0], said
            assert diff > 1e-4, diff


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulated_uneven_micro_batches_under_the_reducer(backend):
    # DistributedOptimizer and DDP weight each micro-batch of a window by its own samples, as
    # ZeroOptimizer does (it was 2.2e-3 from one process: the window scaled once, at its end)
    for _, diff in run_distributed(check_partitioned, 3, backend, args=("DistributedOptimizer",)):
        assert diff < TOL, diff
