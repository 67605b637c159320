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
* `drop_last=False, pad=False`: every sample is read exactly once, so shards differ by at most
  one sample (100 on 3 ranks: 34/33/33) and the epoch is the one-process epoch, batch for
  batch. A step whose global batch does not split evenly (the last) holds different numbers
  of samples on the ranks; the loader tells the data-parallel reducer each batch's size, and
  that step's gradients are averaged over samples, not ranks (m_k / n, `parallel/data_parallel/samples.py`),
  which gives one process's result. When the last global batch has fewer samples than there
  are ranks (N % B < k), some ranks have one batch less: run the loop inside `td.join(...)`.
  Batches read under `torch.no_grad()` (evaluation) are not reported.
* `drop_last=True`: only the first `N - N % B` samples of each epoch's order are read, so
  every step is a full global batch on every rank (as `DataLoader(drop_last=True)` would do
  in one process). Different samples are dropped each epoch when shuffling.

The position is state. `loader.state_dict()` says where the job is in its data: the epoch, the
global position in that epoch's order (samples the job's steps have taken: batches handed to
the script, not those a worker prefetched) and what fixes the order (seed, shuffle, length,
global batch); the order's randomness is a function of `(seed, epoch)`, so that is its RNG
state. `td.Checkpointer.save(step, ..., data=loader)` keeps it and `restore(..., data=loader)`
puts it back: the next pass starts at that epoch and position, and the rest of the epoch is
split over however many ranks the job now has (position p: step j of rank r reads positions
p + j*B + r + k*m), so the global batches are the one-process batches and every sample of the
epoch is read once, as if the job had never stopped. A state from another dataset length,
global batch, seed or order is refused, named.
"""

from __future__ import annotations

import itertools
import operator
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from tandem.comm import context
from tandem.comm.groups import Group, group_rank, group_size
from tandem.diagnostics import steps, timeline
from tandem.diagnostics.batches import record as record_batch

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
    `batch_size` (the global batch) matters with `drop_last=True`, and for `step_samples`.
    `pad=False` reads no sample twice: the ranks' shards then differ by up to one sample.
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
        pad: bool = True,
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
        self.pad = pad
        self._next_epoch = 0
        self._start = 0  # the position in its epoch's order where the next pass starts
        self._pass: tuple[int, int] | None = None  # (epoch, start) of the pass being read
        self._taken = 0  # batches of that pass handed to the script
        self._used = self._samples_used()

    def _samples_used(self) -> int:
        """How many positions of each epoch's order the ranks read together."""
        if self.drop_last:
            return self.length - self.length % self.batch_size
        if self.pad:
            return -(-self.length // self.size) * self.size  # rounded up to a multiple of size
        return self.length

    def resize(self, rank: int, size: int) -> None:
        """Be rank `rank` of `size` from now on, at the same data position: the rest of the
        epoch is split over the new number of ranks exactly as a restore on that many ranks
        splits it (`load_state_dict` of this sampler's own `state_dict`). An elastic job's
        `td.elastic.State` calls it (through the loader) after each change of world."""
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if self.batch_size % size:
            raise ValueError(
                f"rank {rank}: the global batch {self.batch_size} does not split over {size} "
                f"ranks: give partition_dataset a batch_size divisible by every world size the "
                f"job may have (e.g. a multiple of 12 for 2 to 4 ranks)")
        position = self.state_dict()
        self.rank, self.size = rank, size
        self._used = self._samples_used()
        self.load_state_dict(position)

    @property
    def epoch(self) -> int:
        """The epoch the next pass will use."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order for the next pass (then `epoch + 1`, and so on).

        After `load_state_dict`, setting the restored epoch keeps the restored position (a
        script that calls `set_epoch(epoch)` at the top of each epoch resumes mid-epoch)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._pass is not None or int(epoch) != self._next_epoch:
            self._start = 0
        self._pass = None
        self._next_epoch = int(epoch)

    def indices(self, epoch: int, start: int = 0) -> list[int]:
        """This rank's indices in `epoch` from position `start` of its order, in the order they
        are read. Does not advance."""
        order = epoch_order(self.length, epoch, self.seed, self.shuffle)
        if self._used > self.length:  # pad by wrapping around (np.resize repeats the array)
            order = np.resize(order, self._used)
        else:
            order = order[: self._used]
        return order[start + self.rank :: self.size].tolist()

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._next_epoch, self._start
        self._next_epoch, self._start = epoch + 1, 0
        self._pass, self._taken = (epoch, start), 0
        return iter(self.indices(epoch, start))

    def __len__(self) -> int:
        """The samples of the next pass on this rank (fewer when it resumes mid-epoch)."""
        return self._count(self._start)

    def _count(self, start: int) -> int:
        return len(range(start + self.rank, self._used, self.size))

    def step_samples(self, step: int) -> tuple[int, bool]:
        """(this rank's samples at `step` of the pass being read, whether the ranks' counts
        differ there).

        The same for every epoch. The counts differ only where the step's global batch
        (positions [start + step * B, start + (step + 1) * B) of the order) is not a multiple
        of `size`.
        """
        start = self._pass[1] if self._pass is not None else self._start
        per_rank = self.batch_size // self.size
        mine = max(0, min(per_rank, self._count(start) - step * per_rank))
        return mine, self.step_total(step) % self.size != 0

    def step_total(self, step: int) -> int:
        """The samples of `step` of the pass being read, over all ranks (its global batch)."""
        start = self._pass[1] if self._pass is not None else self._start
        return max(0, min(self.batch_size, self._used - start - step * self.batch_size))

    def batch_taken(self) -> None:
        """The loader handed one more batch of this pass to the script (one global batch of
        the job's order: every rank takes its step together)."""
        self._taken += 1

    def pass_finished(self) -> None:
        """The pass was read to its end: the state is the next epoch's start."""
        self._pass = None

    def state_dict(self) -> dict[str, Any]:
        """Where the job is in its data: the epoch and the global position in that epoch's order
        (samples taken by the job's steps, whatever its number of ranks), and what fixes the
        order. The same on every rank."""
        epoch, position = self._next_epoch, self._start
        if self._pass is not None:
            epoch, start = self._pass
            position = start + self._taken * self.batch_size
            if position >= self._used:  # the pass's last batch was taken: the next epoch
                epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "length": self.length,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "world_size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass where `state` (from `state_dict`, on any number of ranks) was."""
        mine = {"length": self.length, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            saved = ", ".join(f"{k}={was!r}" for k, (was, _) in differ.items())
            now = ", ".join(f"{k}={v!r}" for k, (_, v) in differ.items())
            raise ValueError(
                f"rank {self.rank}: the saved data position is from a loader with {saved}, this "
                f"one has {now} (length: the dataset's samples; batch_size: the global batch): "
                f"the position in another order means other samples. Restore with the saved "
                f"job's dataset and partition_dataset arguments, or leave data= out of restore "
                f"to start this loader at its first epoch")
        epoch, position = int(state["epoch"]), int(state["position"])
        if position >= self._used:  # (pad=True on another world size pads another length)
            epoch, position = epoch + 1, 0
        self._next_epoch, self._start, self._pass, self._taken = epoch, position, None, 0


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

    def state_dict(self) -> dict[str, Any]:
        """The data position (epoch, place in its order): see `ShardSampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved data position, on any number of ranks."""
        self.sampler.load_state_dict(state)

    group: Group | None = None  # the ranks that share the dataset (partition_dataset's)

    def follow_world(self) -> None:
        """After a change of world (an elastic job): read this rank's share of the new world
        from the same data position, and its share of each global batch. Each pass starts with
        it (one look at the world's rank and size), so a loader kept in a `td.elastic.State`
        resumes at the exact sample whether the State rolled it back or not."""
        if self.group is not None or not context.installed():
            return  # a group's ranks are fixed (an elastic job reduces over the world)
        rank, size = group_rank(None), group_size(None)
        if (rank, size) == (self.sampler.rank, self.sampler.size):
            return
        per_rank = check_batch_size(self.sampler.batch_size, size)
        self.sampler.resize(rank, size)
        self.batch_sampler.batch_size = per_rank
        object.__setattr__(self, "batch_size", per_rank)  # DataLoader refuses it after init

    device: torch.device | None = None  # where each batch is delivered (partition_dataset)
    dtype: torch.dtype | None = None  # the dtype of its floating-point tensors

    def __iter__(self) -> Iterator[Any]:
        self.follow_world()
        # The base iterator is made now (not at the first batch): iter() starts the epoch.
        batches = _timed(super().__iter__(), self.batch_size, self.sampler)
        if self.device is None and self.dtype is None:
            return batches
        return (_placed(batch, self.device, self.dtype) for batch in batches)


def _placed(batch: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    """`batch` with every tensor on `device` and every floating-point one in `dtype` (labels
    and indices keep their integer dtype); tuples, lists and dicts keep their shape."""
    if isinstance(batch, torch.Tensor):
        cast = dtype if dtype is not None and batch.is_floating_point() else None
        return batch.to(device=device, dtype=cast, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {key: _placed(value, device, dtype) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        placed = [_placed(value, device, dtype) for value in batch]
        return type(batch)(*placed) if hasattr(batch, "_fields") else type(batch)(placed)
    return batch


def _floating_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a floating-point torch dtype ("float32", torch.bfloat16, ...), or None."""
    if dtype is None:
        return None
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: give a floating-point dtype for the batches' "
                         f"floating tensors, e.g. dtype='float32' or torch.bfloat16 (labels "
                         f"keep their own dtype)")
    return found


def _timed(batches: Iterator[Any], per_rank: int, sampler: ShardSampler) -> Iterator[Any]:
    """Each batch, with the time the script waited for it reported to `tandem scale`
    (`diagnostics.steps`) and the timeline: two clock reads per batch. A batch read for
    training (grad mode) is also recorded for the gradient reducer (`parallel/data_parallel/samples.py`): its
    share m_k / B of the step, and whether the ranks' shares differ (with pad=False only)."""
    global_batch = sampler.batch_size
    for step in itertools.count():
        start = time.perf_counter_ns()
        try:
            batch = next(batches)
        except StopIteration:
            sampler.pass_finished()
            return
        end = time.perf_counter_ns()
        steps.add_batch((end - start) * 1e-9, per_rank)
        if timeline.ENABLED:
            timeline.batch_fetched(start, end)
        if torch.is_grad_enabled():
            mine, uneven = sampler.step_samples(step)
            total = sampler.step_total(step)
            record_batch(mine / global_batch, uneven, global_batch, mine / total if total else 0.0)
        sampler.batch_taken()
        yield batch


_warned_positionless: set[tuple[str, str]] = set()


def keeps_position(name: str, obj: Any, where: str = "the checkpoint") -> bool:
    """Whether `obj` can be kept as state: False for a data loader or sampler without
    `state_dict()`/`load_state_dict()` (a plain `DataLoader`), said once per name and place
    (`td.Checkpointer`'s checkpoint, `td.elastic.State`'s commits): left out, it restarts at
    its epoch's start, which is what it would do anyway."""
    stateless = not (callable(getattr(obj, "state_dict", None))
                     and callable(getattr(obj, "load_state_dict", None)))
    if not (stateless and isinstance(obj, (DataLoader, Sampler))):
        return True
    if (where, name) not in _warned_positionless:
        _warned_positionless.add((where, name))
        warnings.warn(
            f"{name}={type(obj).__name__} keeps no data position (no state_dict()): it is left "
            f"out of {where}, and a resumed job starts it at its epoch's start (samples of the "
            f"interrupted epoch are read again). Make it with td.partition_dataset, or give it "
            f"state_dict()/load_state_dict()", UserWarning, stacklevel=4)
    return False


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
    pad: bool = True,
    group: Group | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    **loader_kwargs: Any,
) -> tuple[ShardedLoader, int]:
    """A loader over this rank's shard of `dataset`, and the per-rank batch size.

    `batch_size` is the global batch (what one process would use); each of the `size` ranks
    (of `group`, the world by default) reads `batch_size // size` samples per step. See the
    module docstring for how shards are cut and how `drop_last` treats the remainder. Extra
    keyword arguments (`num_workers`, `collate_fn`, `pin_memory`, ...) go to `DataLoader`.

    `pad=False` (with `drop_last=False`) reads every sample exactly once: the shards may differ
    by one sample, and the step whose global batch does not split evenly is averaged over
    samples (each rank's gradient weighted by its batch size), so training equals one process
    with batch `batch_size` on the same samples in the same order. `pad=True` (the default)
    pads the shards to equal length by reading a few samples twice (torch's
    `DistributedSampler(drop_last=False)`). With `drop_last=True`, `pad` changes nothing.

    `device=` delivers every batch there (`device=td.device()`: no `.to(device)` in the loop),
    `dtype=` casts its floating-point tensors (`dtype="float32"`; labels keep theirs).

    Args:
        dataset: a map-style dataset (`__len__` and `__getitem__`), the same on every rank.
        batch_size: the global batch, divisible by the group's size.
        shuffle: shuffle the samples, in a new order each pass (the same on every rank;
            `loader.set_epoch(epoch)` picks an epoch's order).
        seed: the shuffle's seed, the same on every rank.
        drop_last: drop the last global batch when it is not whole.
        pad: as above: True reads a few samples twice so that the shards are equal; False
            reads each sample once and weights the uneven step by samples.
        group: the data-parallel group whose ranks share the dataset (None: the world).
        device: where every batch is delivered (None: where the dataset puts it).
        dtype: the dtype of the batches' floating-point tensors (None: theirs).
        **loader_kwargs: passed to `DataLoader` (`num_workers`, `collate_fn`, ...).

    Returns:
        `(loader, per_rank_batch)`: this rank's loader, and the samples it reads per step
        (`batch_size // size`).

    Raises:
        TypeError: an iterable dataset or one without `__len__`, a `batch_size` that is not an
            int, or a `DataLoader` argument partition_dataset sets itself (sampler,
            batch_sampler, shuffle, drop_last, batch_size).
        ValueError: a `batch_size` below the group's size or not divisible by it (the message
            names the nearest ones that are), a `dtype` that is not floating-point, or this
            rank not a member of `group`.
    """
    target = torch.device(device) if device is not None else None
    floating = _floating_dtype(dtype)
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
        batch_size=batch_size, pad=pad,
    )
    # drop_last is settled by the sampler (whole global batches, or equal or unpadded shards);
    # the loader keeps a final partial batch (the same size on every rank unless pad=False).
    loader = ShardedLoader(
        dataset, batch_size=per_rank, sampler=sampler, drop_last=False, **loader_kwargs
    )
    loader.device, loader.dtype, loader.group = target, floating, group
    return loader, per_rank
