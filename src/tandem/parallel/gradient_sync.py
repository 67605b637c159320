"""One gradient-sync switch for a model, whatever reduces its gradients.

    with td.no_sync(model):                         # micro-batches 1..k-1: accumulate locally
        loss_fn(model(x), y).backward()
    loss_fn(model(x), y).backward()                 # the last one reduces everything
    td.fsdp.set_requires_gradient_sync(model, False)     # or the FSDP2 spelling, on and off

The model's owner (`parallel/layout/owner.py`) is asked to switch whatever reduces its
gradients: its fully_shard units (FSDP2's `set_requires_gradient_sync`), and the reducer of a
`td.DistributedOptimizer` or `td.DistributedDataParallel` over its parameters (their own
`no_sync()`), found through the registry in `parallel/layout/splits.py`; a `td.Pipeline`'s
owner answers for its stage. Wrappers that reduce
at `step()` (ZeroOptimizer, LocalSGD) accumulate anyway, and tensor-parallel layers reduce
activations, not gradients: they need no switch. A model nothing reduces is an error that
says so, rather than a switch that silently does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tandem.parallel.layout.owner import owner_of


def set_requires_gradient_sync(model: Any, requires_sync: bool) -> None:
    """Off: backward keeps gradients local for accumulation; on: the next backward reduces
    them all (every rank must switch alike).

    Args:
        model: a module with `td.fully_shard` units, or whose parameters a
            `td.DistributedOptimizer` or `td.DistributedDataParallel` reduces.
        requires_sync: False to accumulate locally, True to reduce again.

    Raises:
        ValueError: nothing reduces this model's gradients in backward (ZeroOptimizer and
            LocalSGD reduce at step() and need no switch).
    """
    owner = owner_of(model)
    if owner.role != "model":
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {owner.describe()}")
    if not owner.set_gradient_sync(bool(requires_sync)):
        raise ValueError(
            "set_requires_gradient_sync: nothing reduces this model's gradients in backward (no "
            "td.fully_shard unit, no td.DistributedOptimizer or td.DistributedDataParallel over "
            "its parameters); ZeroOptimizer and LocalSGD reduce at step() and need no switch")


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Backward passes inside accumulate locally; the first one after the block reduces them all.

    Args:
        model: as for `set_requires_gradient_sync`.

    Yields:
        None, while the block runs with gradient reduction off.

    Raises:
        ValueError: nothing reduces this model's gradients in backward (as for
            `set_requires_gradient_sync`).
    """
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, True)
