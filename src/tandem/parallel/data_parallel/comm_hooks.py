"""The reducer's communication-hook contract: `GradBucket`, `CommHook`, the default all-reduce.

A hook receives a `GradBucket` whose buffer holds this rank's (already scaled) gradients and
must leave there, once its `Work` is waited for, the sum over the group (see `GradBucket`).
So compression (`tandem.parallel.data_parallel.compression`) and other reductions plug in without the reducer
knowing about them: the reducer imports only this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.comm.engines.backend import Backend, Work
from tandem.comm.groups import Group

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "describe"]


class GradBucket:
    """What a communication hook receives: one bucket's flat buffer and its parameters.

    `buffer` holds this rank's gradients, already multiplied by 1/size for op="mean", followed
    by small integer flags (`tail`: one "used" flag per parameter, and on bucket 0 the
    "contributed" flag of `td.join`). A hook must leave in `buffer`, once its `Work` has been
    waited for, the SUM over the group of every rank's `buffer`: compression may approximate
    the gradients, but the flags must be summed exactly (any float format is exact for them).
    `backend` is the engine to reduce with (the reducer's: a hook never looks it up per
    bucket); `views[j]` is parameter j's gradient inside the buffer; `state` is the hook's own
    per-bucket storage; `contributing` is False when a rank out of data (`td.join`) only
    answers the others with zeros. A hook may issue more collectives from `Work.wait()`: the
    reducer waits for buckets in index order, after launching them all, so that order is the
    same on every rank.
    """

    def __init__(self, index, buffer, numel, views, names, group, size, backend) -> None:
        self.index: int = index
        self.buffer: torch.Tensor = buffer
        self.grads: torch.Tensor = buffer[:numel]
        self.tail: torch.Tensor = buffer[numel:]
        self.views: list[torch.Tensor] = views
        self.names: list[str] = names
        self.group: Group | None = group
        self.size: int = size
        self.backend: Backend = backend
        self.contributing: bool = True  # False while a joined rank only answers the others
        self.state: dict = {}

    def __repr__(self) -> str:
        return f"GradBucket(index={self.index}, params={len(self.views)}, numel={self.grads.numel()})"


CommHook = Callable[[GradBucket], Work]


def allreduce_hook(bucket: GradBucket) -> Work:
    """The default hook: sum the whole buffer in place, asynchronously."""
    return bucket.backend.allreduce(bucket.buffer, "sum", bucket.group)


def describe(hook: CommHook) -> str:
    """A name for the hook that ranks compare when they agree on the reducer's options."""
    name = getattr(hook, "__name__", None)
    if name:
        return name
    # A default repr carries a memory address, which differs between ranks.
    return type(hook).__qualname__ if type(hook).__repr__ is object.__repr__ else repr(hook)
