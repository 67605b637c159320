"""One gradient-sync switch for a model, whatever reduces its gradients.

    with td.no_sync(model):                         # micro-batches 1..k-1: accumulate locally
        loss_fn(model(x), y).backward()
    loss_fn(model(x), y).backward()                 # the last one reduces everything
    td.set_requires_gradient_sync(model, False)     # or the FSDP2 spelling, on and off

The model is asked who reduces its gradients: its fully_shard units (FSDP2's
`set_requires_gradient_sync`), and the reducer of a `td.DistributedOptimizer` or
`td.DistributedDataParallel` over its parameters (their own `no_sync()`), found through the
registry in `parallel/layout/splits.py`; a `td.Pipeline` is asked for its stage. Wrappers that reduce
at `step()` (ZeroOptimizer, LocalSGD) accumulate anyway, and tensor-parallel layers reduce
activations, not gradients: they need no switch. A model nothing reduces is an error that
says so, rather than a switch that silently does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from tandem.parallel.fully_shard.unit import unit_of
from tandem.parallel.layout import splits


def _module(model: Any) -> nn.Module:
    stage = getattr(model, "stage", None)  # a td.Pipeline: this rank's stage
    if isinstance(stage, nn.Module):
        return stage
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {type(model).__name__}")
    return model


def _switches(model: Any) -> tuple[list, list]:
    module = _module(model)
    units = [unit_of(m) for m in module.modules() if unit_of(m) is not None]
    reducers: dict[int, Any] = {}
    for param in module.parameters():
        reducer = splits.reducer_of(param)
        if reducer is not None and not reducer.closed:
            reducers[id(reducer)] = reducer
    return units, list(reducers.values())


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
    units, reducers = _switches(model)
    if not units and not reducers:
        raise ValueError(
            "set_requires_gradient_sync: nothing reduces this model's gradients in backward (no "
            "td.fully_shard unit, no td.DistributedOptimizer or td.DistributedDataParallel over "
            "its parameters); ZeroOptimizer and LocalSGD reduce at step() and need no switch")
    for unit in units:
        unit.requires_gradient_sync = bool(requires_sync)
    for reducer in reducers:
        reducer.set_sync(bool(requires_sync))


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
