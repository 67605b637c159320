"""An optimizer that steps nothing while a fully sharded model trains: refused at its first step.

    model = td.fully_shard(Net())
    opt = torch.optim.AdamW(other.parameters())   # another model's: mistaken for model's
    loss_fn(model(x), y).backward()               # the shards get their gradients
    opt.step()                                    # ValueError: it holds no shard, steps nothing

The job would run to the end with its loss flat and no error. It is the same mistake as an
optimizer built before fully_shard (`splits._refuse_replaced`, which names the replaced
parameters): the model's shards get gradients that no optimizer ever reads. Told apart from two
models trained side by side (a sharded one and a plain one, each with its optimizer) by what
the optimizer would do: at its first step it holds no shard and not one of its parameters has
a gradient, while a fully_shard backward put gradients in shards since the last step of an
optimizer that holds shards.

The cost: one weak reference per unit per backward (`graded`, where the mean lands in the
shard's `.grad`), and per step one dictionary look-up in a global optimizer pre-step hook; the
parameters are read once, at an optimizer's first step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tandem import runtime
from tandem.parallel.layout import splits

_holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> holds shards
_graded: list = [None]  # a weak reference to a shard graded since an optimizer over shards stepped
_watching = [False]


def watch() -> None:
    """From the first fully_shard on, torch optimizers' steps pass `_before_step` (once)."""
    if not _watching[0]:
        register_optimizer_step_pre_hook(_before_step)
        _watching[0] = True


def graded(shard: torch.Tensor) -> None:
    """A backward wrote `shard`'s gradient."""
    _graded[0] = weakref.ref(shard)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    holds = _holds.get(optimizer)
    if holds is None:
        holds = _holds[optimizer] = _first_step(optimizer)
    if holds:
        _graded[0] = None


def _first_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` holds shards; raises when it steps nothing while shards have gradients."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shard = _graded[0]() if _graded[0] is not None else None
    if any(p is shard or splits.kind_of(p) == splits.FULLY_SHARD for p in params):
        return True
    if shard is None or shard.grad is None or any(p.grad is not None for p in params):
        return False
    name = type(optimizer).__name__
    where = f"rank {runtime.rank()}: " if runtime.is_initialized() else ""
    raise ValueError(
        f"{where}{name} holds {len(params)} parameters, none of them a td.fully_shard shard and "
        f"none with a gradient, while the fully sharded model's shards just got theirs from "
        f"backward: its steps would train nothing (another model's parameters?). Build the "
        f"optimizer over the sharded model, after td.fully_shard: "
        f"opt = torch.optim.{name}(model.parameters(), ...)")
