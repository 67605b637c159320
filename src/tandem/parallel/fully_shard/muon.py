"""Muon over fully_shard's flat shards: refused in words that name the alternative.

torch.optim.Muon checks in its constructor that every parameter is 2-D, and fully_shard hands an
optimizer flat 1-D shards, so the user meets torch's "Muon only supports 2D parameters", which
names neither the cause nor what to use. torch has no hook at an optimizer's construction (the
step hooks of `parallel/layout/splits.py` come too late), so the first `td.fully_shard` wraps
Muon's constructor once: the same call, and, only when it fails over a fully_shard shard, the same
ValueError with the cause and the alternative (torch's words kept).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from tandem.parallel.layout import splits

_wrapped: set[type] = set()


def refuse_over_shards() -> None:
    """Wrap torch.optim.Muon's constructor (once per process; nothing where torch has no Muon)."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None or muon in _wrapped:
        return
    original = muon.__init__

    @functools.wraps(original)
    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params)  # a generator is read twice below
        try:
            original(self, params, *args, **kwargs)
        except ValueError as error:
            if not any(splits.kind_of(p) == splits.FULLY_SHARD for p in _tensors(params)):
                raise
            raise ValueError(
                f"{error}: torch.optim.Muon over td.fully_shard's parameters: fully_shard hands "
                f"an optimizer flat 1-D shards, and Muon orthogonalizes whole matrices. Keep the "
                f"model whole and shard Muon by whole matrices instead: "
                f"td.ZeroOptimizer(torch.optim.Muon(matrices)) over td.DistributedDataParallel "
                f"(or td.DistributedOptimizer), each matrix stepped whole by one rank") from error

    muon.__init__ = __init__
    _wrapped.add(muon)


def _tensors(params: Any) -> Iterable[torch.Tensor]:
    """The tensors of an optimizer's `params` argument: tensors, or param groups of them."""
    if isinstance(params, torch.Tensor):
        yield params
        return
    for item in params:
        if isinstance(item, dict):
            group = item.get("params", ())
            yield from [group] if isinstance(group, torch.Tensor) else group
        elif isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, tuple) and len(item) == 2:  # (name, parameter)
            yield item[1]
