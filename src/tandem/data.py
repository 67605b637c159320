"""Data partitioning: each rank reads a disjoint shard of the dataset, reshuffled every epoch.

    loader, per_rank_batch = td.partition_dataset(dataset, batch_size=128)   # the GLOBAL batch
    for epoch in range(epochs):
        for x, y in loader:          # a new order on every pass (or loader.set_epoch(epoch))
            ...

How the shards are cut. Every rank computes the same permutation of the dataset from
`(seed, epoch)` alone (no communication), and rank r of k takes positions r, r+k, r+2k, ...
of it. Step j on rank r therefore reads positions j*B + r + k*m of the permutation, so the k
ranks together read exactly positions [j*B, (j+1)*B): the batch one process with batch B
would read. With `op="mean"` this makes k ranks reproduce the single-process run step for step.

Remainders (N samples, k ranks, global batch B):

* `drop_last=False` (default): every sample is read each epoch. When N is not a multiple of
  k, the permutation is extended by wrapping around to its start, so the first
  `k - N % k` samples of the epoch's order are read twice (once more than the rest) and every
  rank has ceil(N / k) samples. The last step may hold fewer than B samples; it holds the same
  number on every rank, so a mean over ranks is still the mean over the batch.
* `drop_last=True`: only the first `N - N % B` samples of each epoch's order are read, so
  every step is a full global batch on every rank (as `DataLoader(drop_last=True)` would do
  in one process). Different samples are dropped each epoch when shuffling.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from tandem.comm.groups import Group, group_rank, group_size
from tandem.diagnostics import steps, timeline

# Keyword arguments `partition_dataset` sets itself; passing them through would contradict it.
_RESERVED = ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last")


def epoch_order(length: int, epoch: int, seed: int = 0, shuffle: bool = True) -> np.ndarray:
    """The order of the whole dataset in `epoch`: the same on every rank, from `(seed, epoch)`."""
    if not shuffle:
        return np.arange(length)
    # A seed *sequence* keeps (seed=0, epoch=1) and (seed=1, epoch=0) apart.
    return np.random.default_rng((int(seed), int(epoch))).permutation(length)


class ShardSampler(Sampler[int]):
    """Dataset indices for one rank: its shard of the epoch's permutation.

    `rank` and `size` are explicit, so the sampler is a pure function of its arguments and can
    be tested (or used) without any processes. Each call to `iter()` uses the current epoch
    and then advances it by one; `set_epoch(e)` chooses the epoch of the next pass. Every rank
    must therefore start the same number of passes (or call `set_epoch` with the same value).
    `batch_size` (the global batch) only matters with `drop_last=True`.
    """

    def __init__(
        self,
        length: int,
        rank: int,
        size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if length < 1:
            raise ValueError("the dataset is empty: there is nothing to partition")
        if batch_size is None:  # only drop_last needs it: whole global batches are kept
            batch_size = size
        if batch_size < 1 or batch_size % size:
            raise ValueError(f"batch_size (global) must be a positive multiple of {size}, got {batch_size}")
        if drop_last and length < batch_size:
            raise ValueError(
                f"drop_last=True with a dataset of {length} samples and a global batch of "
                f"{batch_size} leaves no full batch: pass drop_last=False or a batch_size "
                f"of at most {length}"
            )
        self.length = length
        self.rank = rank
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_size = batch_size
        self._next_epoch = 0
        if drop_last:
            self._used = length - length % batch_size
        else:
            self._used = -(-length // size) * size  # rounded up to a multiple of size

    @property
    def epoch(self) -> int:
        """The epoch the next pass will use."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order for the next pass (then `epoch + 1`, and so on)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._next_epoch = int(epoch)

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices in `epoch`, in the order they are read. Does not advance."""
        order = epoch_order(self.length, epoch, self.seed, self.shuffle)
        if self._used > self.length:  # pad by wrapping around (np.resize repeats the array)
            order = np.resize(order, self._used)
        else:
            order = order[: self._used]
        return order[self.rank :: self.size].tolist()

    def __iter__(self) -> Iterator[int]:
        epoch = self._next_epoch
        self._next_epoch += 1
        return iter(self.indices(epoch))

    def __len__(self) -> int:
        return self._used // self.size


class ShardedLoader(DataLoader):
    """A `DataLoader` over one rank's shard, with `set_epoch` and `epoch` from its sampler."""

    sampler: ShardSampler

    def set_epoch(self, epoch: int) -> None:
        """Read `epoch`'s order on the next pass; later passes continue from there."""
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next pass will use."""
        return self.sampler.epoch

    def __iter__(self) -> Iterator[Any]:
        # The base iterator is made now (not at the first batch): iter() starts the epoch.
        return _timed(super().__iter__(), self.batch_size)


def _timed(batches: Iterator[Any], per_rank: int) -> Iterator[Any]:
    """Each batch, with the time the script waited for it reported to `tandem scale`
    (`diagnostics.steps`) and the timeline: two clock reads per batch."""
    while True:
        start = time.perf_counter_ns()
        try:
            batch = next(batches)
        except StopIteration:
            return
        end = time.perf_counter_ns()
        steps.add_batch((end - start) * 1e-9, per_rank)
        if timeline.ENABLED:
            timeline.batch_fetched(start, end)
        yield batch


def check_batch_size(batch_size: int, size: int) -> int:
    """The per-rank batch for a global `batch_size` over `size` ranks, or an error with the fix."""
    if isinstance(batch_size, bool):
        raise TypeError(f"batch_size must be an int (the global batch), got {batch_size!r}")
    try:
        batch_size = operator.index(batch_size)  # ints, NumPy ints; not floats
    except TypeError:
        raise TypeError(f"batch_size must be an int (the global batch), got {batch_size!r}") from None
    if batch_size < size:
        raise ValueError(
            f"batch_size={batch_size} is the global batch, shared by {size} ranks, so it must be "
            f"at least {size}: pass batch_size={size} or more (a multiple of {size})"
        )
    if batch_size % size:
        lower = batch_size - batch_size % size
        raise ValueError(
            f"batch_size={batch_size} (the global batch) is not divisible by the {size} ranks: "
            f"pass batch_size={lower} or {lower + size} (each rank then gets batch_size // {size})"
        )
    return batch_size // size


def partition_dataset(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    *,
    group: Group | None = None,
    **loader_kwargs: Any,
) -> tuple[ShardedLoader, int]:
    """A loader over this rank's shard of `dataset`, and the per-rank batch size.

    `batch_size` is the global batch (what one process would use); each of the `size` ranks
    (of `group`, the world by default) reads `batch_size // size` samples per step. See the
    module docstring for how shards are cut and how `drop_last` treats the remainder. Extra
    keyword arguments (`num_workers`, `collate_fn`, `pin_memory`, ...) go to `DataLoader`.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"partition_dataset needs a map-style dataset with __len__ and __getitem__, got "
            f"{type(dataset).__name__}; shard an IterableDataset inside its __iter__ by td.rank()"
        )
    clashes = [key for key in _RESERVED if key in loader_kwargs]
    if clashes:
        raise TypeError(
            f"partition_dataset sets {', '.join(clashes)} itself; pass batch_size (global), "
            f"shuffle and drop_last as its own arguments and leave out sampler/batch_sampler"
        )
    size, rank = group_size(group), group_rank(group)
    if rank < 0:
        raise ValueError(f"this rank is not a member of {group!r}; only members can read a shard")
    # `tandem scale --mode weak` keeps the per-rank batch: the global one grows with the world.
    batch_size = steps.scaled_batch(batch_size, size)
    per_rank = check_batch_size(batch_size, size)
    sampler = ShardSampler(
        len(dataset), rank, size, shuffle=shuffle, seed=seed, drop_last=drop_last,
        batch_size=batch_size,
    )
    # drop_last is settled by the sampler (whole global batches, or equal shards); the loader
    # keeps a final partial batch, which then has the same size on every rank.
    loader = ShardedLoader(
        dataset, batch_size=per_rank, sampler=sampler, drop_last=False, **loader_kwargs
    )
    return loader, per_rank
