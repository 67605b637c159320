"""`td.join`: data-parallel training when ranks have different numbers of batches.

    with td.join(opt):                      # opt: a DistributedOptimizer
        for x, y in loader:                 # this rank's shard: any length
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    with td.join(ddp_model, optimizer):     # a DistributedDataParallel and its torch optimizer

    for x, y in loader: ...                 # Horovod's style: after the loop,
    last = td.join()                        # returns the last rank to run out of data

Without it, the rank that runs out of batches first leaves the others waiting for its share of
the next gradient all-reduce, until the timeout. PyTorch's `Join` and Horovod's `hvd.join()`
solve it the same way, and so does this:

- Every gradient reduction carries, in the tail of bucket 0, a "contributed" flag: 1 from a
  rank that computed gradients. It rides in a message that is sent anyway: free when unused.
- A rank that is out of data keeps *answering*: each round it all-reduces zero buckets
  (through the same communication hook, in the same order) with the flag at 0, so the others
  never wait for it. When the summed flag is 0, every rank is out of data, and all stop
  together after that round: the same decision on every rank, so it cannot deadlock.
- With `with td.join(...)`, the ranks still training know it, and average over the ranks that
  contributed that round (sum / summed flag): a round with 3 of 4 ranks equals one process
  training on those 3 shards' samples. At the end, the parameters and optimizer state of the
  rank that stepped the most are copied to every rank (`sync_state=True`), so the replicas
  leave the block identical. Pass the torch optimizer of a `DistributedDataParallel` model
  too, or its state (momentum, Adam moments) stays stale on the ranks that left early.
- `td.join()` without arguments (Horovod's `hvd.join()`) needs no change to the loop: the
  training ranks do not know anyone left, so they keep dividing by the group size, i.e. the
  ranks out of data count as zero gradients (PyTorch DDP's default). It answers for the one
  data-parallel optimizer of the process, copies no state, and returns the last rank to join.

Limits: while some rank is out of data, the others may not run other collectives (a metric
all-reduce, a SyncBatchNorm forward, a buffer broadcast), because that rank cannot answer
them; inside `with td.join(...)` SyncBatchNorm raises an error that says so, and
`DistributedDataParallel` stops broadcasting buffers.
"""

from __future__ import annotations

import gc
import types
from typing import Any

import torch

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.groups import group_ranks, group_size

_active = 0


def join_active() -> bool:
    """Whether a `td.join` block is running in this process (SyncBatchNorm refuses to sync)."""
    return _active > 0


def _split_kind(optimizer: Any) -> str | None:
    """How the parameters a torch optimizer steps are split (fully_shard, tensor parallel,
    Branches, pipeline), if they are."""
    from tandem.parallel.layout import splits

    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    for group in optimizer.param_groups:
        for param in group["params"]:
            kind = splits.kind_of(param)
            if kind in splits.MODEL_SPLITS:
                return kind
    return None


class Join:
    """The context manager `td.join(...)` returns; see the module docstring."""

    def __init__(self, wrappers: tuple[Any, ...], sync_state: bool) -> None:
        from tandem.parallel.layout.owner import owner_of

        if not wrappers:
            raise TypeError(
                "td.join needs the DistributedOptimizer (or DistributedDataParallel) whose "
                "reductions the ranks share, e.g. `with td.join(opt):`"
            )
        owners = [owner_of(wrapper) for wrapper in wrappers]
        for wrapper, owner in zip(wrappers, owners, strict=True):
            split = _split_kind(wrapper)
            if split is not None and not owner.answers_join:
                raise TypeError(
                    f"td.join cannot stand in for a rank out of data in a {split} model: its "
                    f"gathers and reductions run inside forward and backward, which that rank "
                    f"no longer runs. Give every rank the same number of batches "
                    f"(td.partition_dataset(..., drop_last=True)), or stop together when one "
                    f"rank runs out (`if not td.all_finite(...)`-style: agree with td.allreduce)")
            if not owner.answers_join and not isinstance(wrapper, torch.optim.Optimizer):
                raise TypeError(
                    f"td.join takes DistributedOptimizer, DistributedDataParallel or (for their state "
                    f"only) torch optimizer objects, got {owner.describe()}"
                )
        if not any(owner.answers_join for owner in owners):
            raise TypeError("td.join needs a DistributedOptimizer or DistributedDataParallel to answer for")
        self._wrappers = wrappers
        self._reducers = [owner.reducer() for owner in owners if owner.reducer() is not None]
        self._sync_state = sync_state

    def __enter__(self) -> Join:
        global _active
        for reducer in self._reducers:
            reducer.enter_join()
        _active += 1
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> bool:
        global _active
        try:
            if exc_type is None and self._reducers:
                for reducer in self._reducers:
                    if reducer.has_pending():
                        raise RuntimeError(
                            "td.join: this rank left the loop between backward() and step(); call "
                            "step() on every iteration inside the block"
                        )
                # all() stops at the first False, and a False is seen by every rank at once.
                while all(reducer.shadow_round() for reducer in self._reducers):
                    pass
                if self._sync_state:
                    self._sync_from_last_joiner()
        finally:
            _active -= 1
            for reducer in self._reducers:
                reducer.exit_join()
        return False

    def _sync_from_last_joiner(self) -> None:
        """Copy the state of the rank that stepped the most (lowest such rank) to all ranks:
        each wrapper's owner (`parallel/layout/owner.py`) knows what its state is."""
        from tandem.parallel.layout.owner import owner_of

        group = self._reducers[0].group
        root = _last_joiner(self._reducers[0])
        for wrapper in self._wrappers:
            owner_of(wrapper).copy_from(root, group)


def _last_joiner(reducer) -> int:
    """The global rank that stepped the most (the lowest such rank). Collective."""
    group = reducer.group
    n = group_size(group)
    # max(rounds * n + (n - 1 - me)) names the most rounds, then the lowest rank.
    code = torch.tensor([reducer.rounds * n + (n - 1 - reducer.group_rank())], dtype=torch.int64)
    work, code = direct.allreduce_into(code, "max", group)
    work.wait(runtime.state().timeout)
    return group_ranks(group)[n - 1 - int(code.item()) % n]


def join(*wrappers: Any, sync_state: bool = True) -> Any:
    """Ranks with uneven numbers of batches; see `tandem.parallel.data_parallel.join`.

    With wrappers: a context manager around the training loop. Without: answer the other
    ranks' reductions until all are done, and return the last rank to join.

    Args:
        *wrappers: the `DistributedOptimizer` or `DistributedDataParallel` whose reductions the
            ranks share, and the torch optimizer of a DistributedDataParallel model (for its
            state); none for Horovod's `hvd.join()` style, after the loop.
        sync_state: on leaving the block, copy the parameters and optimizer state of the rank
            that stepped the most to every rank.

    Returns:
        With wrappers, the context manager to put around the loop; without, the global rank
        that stepped the most (the last to join; the lowest such rank).

    Raises:
        TypeError: a wrapper is not a DistributedOptimizer, DistributedDataParallel or torch
            optimizer, none of them reduces, or the model is split (fully_shard, ZeroOptimizer,
            tensor or pipeline parallel), which a rank out of data cannot stand in for.
        ValueError: without wrappers, the process holds several data-parallel optimizers or
            models (use `with td.join(opt, ...):`).
        RuntimeError: without wrappers, called between backward() and step().
    """
    if wrappers:
        return Join(wrappers, sync_state)
    from tandem.parallel.data_parallel.reducer import live_reducers

    gc.collect()  # optimizers dropped earlier must not count
    reducers = live_reducers()
    if not reducers:
        return runtime.rank() if runtime.is_initialized() else 0
    if len(reducers) > 1:
        raise ValueError(
            f"td.join(): this process has {len(reducers)} data-parallel optimizers/models, so it "
            f"cannot tell whose reductions to answer; use `with td.join(opt, ...):` around the loop"
        )
    reducer = reducers[0]
    if reducer.has_pending():
        raise RuntimeError("td.join() was called between backward() and step(); call step() first")
    while reducer.shadow_round():
        pass
    if reducer.step_check is not None:
        reducer.step_check.rebase()  # the ranks ran different numbers of steps
    return _last_joiner(reducer)
