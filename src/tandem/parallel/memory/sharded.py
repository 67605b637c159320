"""fully_shard's bytes: its units (from a wrapped model, or planned from `units=`), their
padded shards, and the most its step keeps alive at once (`parallel/fully_shard/unit.py`'s
schedule)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.parallel.fully_shard.reduction import MAX_IN_FLIGHT
from tandem.parallel.memory.layouts import optimizer_bytes, padded
from tandem.parallel.memory.report import MemoryEstimate


@dataclass(frozen=True)
class Unit:
    """One fully_shard unit as the estimate sees it: its parameter count and dtype."""

    name: str
    numel: int
    dtype: torch.dtype


def wrapped_units(model: nn.Module) -> list[Unit] | None:
    """The units of a model wrapped by td.fully_shard (root last), None when there are none."""
    from tandem.parallel.fully_shard import units

    found = [(name, unit) for name, unit in units(model)]
    if not found:
        return None
    found.sort(key=lambda item: item[1].is_root)  # the root last, the others in module order
    out = [Unit(name, unit.numel, unit.shard.dtype) for name, unit in found]
    if not found[-1][1].is_root:  # a root that only holds units: nothing of its own to gather
        out.append(Unit("", 0, out[-1].dtype))
    return out


def planned_units(model: nn.Module, units: Iterable[nn.Module | str] | None) -> list[Unit]:
    """The units `td.fully_shard` would make of `units` and then the root (each owning the
    parameters no inner unit owns), in module order, the root last."""
    names = {id(m): name for name, m in model.named_modules()}
    if isinstance(units, (str, nn.Module)) and not isinstance(units, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"units takes a list of modules or qualified names (units=model.blocks, "
                        f"units=['encoder', 'decoder']), got one {type(units).__name__}: put it "
                        f"in a list")
    chosen: list[nn.Module] = []
    for unit in (units or ()):
        if isinstance(unit, str):
            module = dict(model.named_modules()).get(unit)
            if module is None:
                raise ValueError(f"units: the model has no submodule {unit!r}; give qualified "
                                 f"names from model.named_modules(), e.g. 'blocks.0'")
        elif isinstance(unit, nn.Module):
            module = unit
        else:
            raise TypeError(f"units takes modules or their qualified names, got "
                            f"{type(unit).__name__}")
        if id(module) not in names:
            raise ValueError(f"units: {type(module).__name__} is not a submodule of this model")
        if module is not model:
            chosen.append(module)
    marked = {id(m) for m in chosen}
    seen: set[int] = set()

    def owned(module: nn.Module) -> tuple[int, torch.dtype]:
        """The parameters reached from `module` without entering another unit (once each)."""
        numel, dtype, stack = 0, torch.float32, [module]
        while stack:
            m = stack.pop()
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    numel, dtype = numel + p.numel(), p.dtype
            stack.extend(c for c in m._modules.values() if c is not None and id(c) not in marked)
        return numel, dtype

    # innermost first, as td.fully_shard is applied; reported in module order, the root last
    order = sorted(chosen, key=lambda m: -len(names[id(m)].split(".")))
    made = {id(m): owned(m) for m in order}
    root = owned(model)
    out = [Unit(names[id(m)], *made[id(m)]) for m in model.modules() if id(m) in made]
    out = [u for u in out if u.numel]  # a unit without parameters of its own holds nothing
    return out + [Unit("", *root)]


def fully_shard(base: dict, found: list[Unit], n: int, optimizer: str,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 offload: str | None, one_unit: bool) -> MemoryEstimate:
    shards = [padded(u.numel, n) for u in found]
    params = sum(s * u.dtype.itemsize for s, u in zip(shards, found, strict=True))
    notes = ["the peak assumes zero_grad(set_to_none=False); with set_to_none=True (torch's "
             "default) it is lower by the gradients' bytes"]
    if one_unit:
        notes.append("the whole model is one unit (gathered whole): give units= "
                     "(e.g. units=model.blocks) for one unit per block")
    gathered, reducing, casts = [], [], []
    for s, u in zip(shards, found, strict=True):
        compute, reduce = param_dtype or u.dtype, reduce_dtype or u.dtype
        gathered.append(n * s * compute.itemsize)
        # the packed gradient (+ one inf/NaN flag and one weight per rank) and, over several
        # ranks, the buffer the reduce-scatter writes this rank's part into (added into an
        # existing .grad)
        reducing.append((n + (n > 1)) * (s + 2) * reduce.itemsize)
        casts.append(n * s * reduce.itemsize if compute != reduce else 0)  # grad.to(reduce)
    return MemoryEstimate(
        **base, params=params, grads=params,
        optimizer_state=optimizer_bytes(params, len(found), optimizer),
        transient=step_peak(gathered, reducing, casts), offload=offload, notes=tuple(notes))


def step_peak(gathered: list[int], reducing: list[int], casts: list[int]) -> int:
    """The most bytes of gathered units and in-flight gradient reductions alive at once.

    `parallel/fully_shard/unit.py`'s schedule, units in forward order, the root last in the
    lists: the root stays gathered from its forward until its own reduce-scatter, which comes
    last in backward; a unit's forward prefetches the next, its backward the one before; a
    unit's gradient (gathered size) is packed for its reduce-scatter, and starting one waits
    for the oldest beyond `MAX_IN_FLIGHT` (`fully_shard/reduction.py`), so the packed
    gradients of at most that many units behind it are still alive.
    """
    *inner, root_g = gathered
    *rs, root_rs = reducing
    *cast, root_cast = casts
    m = len(inner)
    peak = root_g + (inner[0] if inner else 0)
    for k in range(m):
        after = inner[k + 1] if k + 1 < m else 0
        before = inner[k - 1] if k > 0 else 0
        behind = sum(rs[k + 1:k + 1 + MAX_IN_FLIGHT])
        peak = max(peak,
                   root_g + inner[k] + after,  # forward: this unit and the prefetched next
                   # backward: this unit, the one prefetched before it, its fresh gradient,
                   # then the gradient cast and packed while the gathered copy is freed
                   root_g + before + inner[k] + inner[k] + behind,
                   root_g + before + inner[k] + cast[k] + rs[k] + behind)
    # the root's own gradient at the very end (its gathered copy freed as it is packed); then
    # every packed gradient until the wait
    last = sum(rs[:MAX_IN_FLIGHT])  # the last units of backward, still reducing
    return max(peak, root_g + root_g + last, root_g + root_cast + root_rs + last)
