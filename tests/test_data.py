"""partition_dataset and its sampler: shards are disjoint, cover the dataset, reshuffle per epoch.

The sampler is a pure function of (length, rank, size, seed, epoch), so most checks build one
sampler per rank in this process; one test runs real ranks through `partition_dataset`.
"""

import os
import time
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import tandem as td
from tandem.comm.groups import Group
from tandem.data import ShardSampler, check_batch_size, epoch_order, partition_dataset
from tandem.diagnostics import steps, timeline
from tandem.job import settings
from tandem.testing import run_distributed


def _shards(length, size, epoch=0, **kwargs):
    samplers = [ShardSampler(length, rank, size, **kwargs) for rank in range(size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("length,size", [(12, 3), (10, 4), (7, 2), (1, 3), (100, 8)])
def test_union_is_the_dataset_and_ranks_have_equal_counts(length, size):
    shards = _shards(length, size, epoch=3)
    assert len({len(s) for s in shards}) == 1, "every rank must read the same number of samples"
    union = Counter(i for shard in shards for i in shard)
    assert set(union) == set(range(length))
    padding = -length % size
    order = epoch_order(length, 3)
    # The padded (repeated) samples are the first `padding` of the epoch's order, wrapped around.
    repeated = Counter(order[i % length] for i in range(padding))
    assert union == Counter(range(length)) + repeated
    if padding == 0:
        assert sum(union.values()) == length  # disjoint


def test_drop_last_keeps_only_whole_global_batches():
    length, size, batch = 23, 2, 6
    shards = _shards(length, size, epoch=1, drop_last=True, batch_size=batch)
    assert [len(s) for s in shards] == [9, 9]  # 18 = 3 global batches of 6, 5 samples dropped
    union = [i for shard in shards for i in shard]
    assert len(set(union)) == len(union) == 18
    assert set(union) == set(epoch_order(length, 1)[:18].tolist())


def test_each_step_reads_the_single_process_batch():
    """Rank r's j-th batch, over all ranks, is the j-th batch of one process with the global batch."""
    length, size, batch = 40, 4, 8
    per_rank = batch // size
    shards = _shards(length, size, epoch=2)
    single = _shards(length, 1, epoch=2)[0]
    for step in range(length // batch):
        together = sorted(i for s in shards for i in s[step * per_rank : (step + 1) * per_rank])
        assert together == sorted(single[step * batch : (step + 1) * batch])


def test_reshuffled_every_epoch_and_identical_across_ranks():
    first = _shards(50, 2, epoch=0)
    second = _shards(50, 2, epoch=1)
    assert first != second
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(50))
    # Two independent sampler instances (two "ranks") compute the same permutation.
    assert _shards(50, 2, epoch=1) == second
    assert _shards(50, 2, epoch=1, seed=5) != second
    assert _shards(6, 2, epoch=4, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


def test_epoch_advances_on_each_pass_and_set_epoch_chooses_it():
    sampler = ShardSampler(30, 0, 3)
    passes = [list(sampler) for _ in range(3)]
    assert passes == [sampler.indices(e) for e in range(3)]
    assert sampler.epoch == 3
    sampler.set_epoch(1)
    assert list(sampler) == passes[1]
    assert list(sampler) == passes[2]


def test_bad_batch_sizes_name_the_value_to_pass():
    assert check_batch_size(12, 4) == 3
    with pytest.raises(ValueError, match=r"batch_size=2 .* at least 4: pass batch_size=4"):
        check_batch_size(2, 4)
    with pytest.raises(ValueError, match=r"not divisible by the 4 ranks: pass batch_size=8 or 12"):
        check_batch_size(10, 4)
    with pytest.raises(TypeError, match="must be an int"):
        check_batch_size(8.0, 2)
    with pytest.raises(ValueError, match="leaves no full batch"):
        ShardSampler(5, 0, 2, drop_last=True, batch_size=8)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_rejects_iterable_datasets_and_sampler_arguments():
    with pytest.raises(TypeError, match="map-style dataset"):
        partition_dataset(_Stream(), batch_size=2)
    with pytest.raises(TypeError, match="sets sampler itself"):
        partition_dataset(TensorDataset(torch.arange(4)), batch_size=2, sampler=None)


def check_partition_dataset(length, batch):
    """Run by every rank: read two epochs automatically, then epoch 0 again via set_epoch."""
    dataset = TensorDataset(torch.arange(length))
    loader, per_rank = td.partition_dataset(dataset, batch_size=batch, seed=7, num_workers=0)
    epochs = []
    for _ in range(2):
        batches = [x.tolist() for (x,) in loader]
        assert all(len(b) <= per_rank for b in batches)
        epochs.append([i for b in batches for i in b])
    loader.set_epoch(0)
    again = [i for (x,) in loader for i in x.tolist()]
    errors = []
    for bad in (1, td.size() * 2 + 1):
        try:
            td.partition_dataset(dataset, batch_size=bad)
        except ValueError as error:
            errors.append(str(error))
    return {"per_rank": per_rank, "batches": len(loader), "epochs": epochs, "again": again,
            "errors": errors}


@pytest.mark.timeout(120)
def test_partition_dataset_on_real_ranks():
    length, batch = 21, 4
    results = run_distributed(check_partition_dataset, world_size=2, args=(length, batch))
    assert [r["per_rank"] for r in results] == [2, 2]
    assert [r["batches"] for r in results] == [6, 6]  # ceil(21 / 2) = 11 samples -> 6 batches
    for epoch in range(2):
        union = Counter(i for r in results for i in r["epochs"][epoch])
        assert set(union) == set(range(length)) and sum(union.values()) == 22  # one repeat
    assert results[0]["epochs"][0] != results[0]["epochs"][1], "not reshuffled"
    assert all(r["again"] == r["epochs"][0] for r in results)
    for r in results:
        assert len(r["errors"]) == 2
        assert "pass batch_size=2" in r["errors"][0] and "pass batch_size=4 or 6" in r["errors"][1]


# -- partition_dataset without processes: a sub-group given by hand -------------------------
# (found by mutation testing: scripts/mutation.sh). A `Group` is plain data (ranks, this
# process's index), so rank r of k can be played in this process.


def _group(rank: int, size: int) -> Group:
    return Group(tuple(range(size)), None, rank)


def _epoch(loader) -> list[list[int]]:
    return [x.tolist() for (x,) in loader]


def test_partition_dataset_gives_each_group_rank_its_shard():
    dataset = TensorDataset(torch.arange(23))
    loaders = [partition_dataset(dataset, batch_size=6, group=_group(r, 3)) for r in range(3)]
    assert [per_rank for _, per_rank in loaders] == [2, 2, 2]
    # The defaults: shuffled, seed 0, every sample read (padded by wrapping around).
    for rank, (loader, _) in enumerate(loaders):
        assert _epoch(loader) == [b.tolist() for b in torch.tensor(
            ShardSampler(23, rank, 3, shuffle=True, seed=0, drop_last=False).indices(0)).split(2)]
        assert len(loader) == 4 and loader.epoch == 1
    single, per_rank = partition_dataset(dataset, batch_size=6, group=_group(0, 1))
    assert per_rank == 6
    for loader, _ in loaders:
        loader.set_epoch(0)
    steps_together = zip(*(_epoch(loader) for loader, _ in loaders), strict=True)
    # Step for step, the ranks together read the one-process batch (the last, padded step aside).
    for step, batches in list(zip(_epoch(single), steps_together, strict=True))[:-1]:
        assert sorted(i for b in batches for i in b) == sorted(step)


def test_partition_dataset_passes_its_options_on():
    dataset = TensorDataset(torch.arange(23))
    loader, _ = partition_dataset(dataset, batch_size=6, shuffle=False, drop_last=True,
                                  seed=3, group=_group(1, 3), collate_fn=lambda rows: rows)
    assert loader.sampler.indices(0) == [1, 4, 7, 10, 13, 16]  # 18 of 23 kept, in order
    assert (loader.sampler.seed, loader.sampler.batch_size, loader.sampler.drop_last) == (3, 6, True)
    assert [len(batch) for batch in loader] == [2, 2, 2]  # collate_fn kept the rows as a list
    loader.set_epoch(5)
    assert loader.epoch == 5 and loader.sampler.epoch == 5
    shuffled, _ = partition_dataset(dataset, batch_size=6, seed=3, group=_group(1, 3))
    assert shuffled.sampler.indices(2) == ShardSampler(23, 1, 3, seed=3).indices(2)


def test_partition_dataset_refuses_a_non_member_and_weak_mode_scales(monkeypatch):
    dataset = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match=r"not a member of Group\(ranks=\[0, 1\]\); only members"):
        partition_dataset(dataset, batch_size=2, group=_group(-1, 2))
    loader, per_rank = partition_dataset(dataset, batch_size=2, group=_group(0, 2))
    assert (per_rank, len(loader)) == (1, 4)
    monkeypatch.setenv("TANDEM_SCALE_MODE", "weak")  # the batch is per rank: 2 ranks read 4
    settings.reload()
    loader, per_rank = partition_dataset(dataset, batch_size=2, group=_group(0, 2))
    assert (per_rank, loader.sampler.batch_size) == (2, 4)


def test_the_loader_reports_each_batch_and_its_wait():
    steps.reset()
    loader, _ = partition_dataset(TensorDataset(torch.arange(12)), batch_size=4,
                                  group=_group(0, 2))
    steps.step_done(0.0)  # starts the clock
    timeline.start(os.devnull, capacity=16)
    try:
        before = time.perf_counter_ns()
        batches = list(loader)
        after = time.perf_counter_ns()
        events = [e for e in timeline._events[: timeline._count] if e and e[0] == "data"]
    finally:
        timeline.stop()
    steps.step_done(0.0)
    (record,) = steps.records()
    steps.reset()
    assert len(batches) == 3 and record.samples == 3 * 2
    assert 0 <= record.data_s <= (after - before) * 1e-9  # the waits lie inside the loop
    assert len(events) == 3
    assert all(before <= start <= end <= after for _, start, end, _, _ in events), events


def test_sampler_limits_are_exact():
    assert len(ShardSampler(5, 4, 5)) == 1 and isinstance(len(ShardSampler(7, 0, 2)), int)
    for kwargs, message in [
        (dict(length=4, rank=0, size=0), "size must be >= 1, got 0"),
        (dict(length=4, rank=2, size=2), r"rank must be in \[0, 2\), got 2"),
        (dict(length=4, rank=-1, size=2), r"rank must be in \[0, 2\), got -1"),
        (dict(length=0, rank=0, size=1), "^the dataset is empty: there is nothing to partition$"),
        (dict(length=4, rank=0, size=2, batch_size=3),
         r"batch_size \(global\) must be a positive multiple of 2, got 3"),
        (dict(length=4, rank=0, size=2, batch_size=0),
         r"batch_size \(global\) must be a positive multiple of 2, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ShardSampler(**kwargs)
    exact = ShardSampler(6, 0, 2, drop_last=True, batch_size=6)  # one whole batch: allowed
    assert exact.indices(0) == epoch_order(6, 0)[0::2].tolist()
    assert ShardSampler(6, 1, 2, shuffle=False).indices(0) == [1, 3, 5]  # no padding needed
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        exact.set_epoch(-1)
    assert check_batch_size(4, 4) == 1 and isinstance(check_batch_size(6, 4 // 2), int)
    with pytest.raises(TypeError, match="must be an int .the global batch., got True"):
        check_batch_size(True, 1)


class _SizedStream(IterableDataset):
    def __iter__(self):
        return iter(range(3))

    def __len__(self):
        return 3


def test_iterable_datasets_and_reserved_arguments_are_named():
    with pytest.raises(TypeError, match="map-style dataset with __len__ and __getitem__, got _SizedStream;"):
        partition_dataset(_SizedStream(), batch_size=2, group=_group(0, 1))
    with pytest.raises(TypeError, match="partition_dataset sets sampler, batch_sampler itself"):
        partition_dataset(TensorDataset(torch.arange(4)), batch_size=2, batch_sampler=None,
                          sampler=None)
