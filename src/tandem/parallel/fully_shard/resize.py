"""A fully sharded model (and its optimizer's state) cut again for a new world (td.elastic).

After a change of world every unit of the model is cut for the new size (`reshard_units`):
each shard keeps its `nn.Parameter` (the optimizer's), which gets its new size, zeros until
`td.elastic.State` loads the committed model into it from the
parts the ranks held. A commit keeps this rank's part of each unit's flat space, of the
parameters (`model_state`, with the buffers) and of the optimizer's per-element state (Adam's
moments, SGD's momentum: `optimizer_shards`), a copy with no communication; after the change
each rank assembles its new part from the parts the others held (`load_model_state`,
`load_optimizer_shards`); `lost` names what no remaining rank holds (a rank that left took
it: a checkpoint on disk is then the only source).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tandem.comm.groups import group_rank, group_size
from tandem.parallel.fully_shard.api import units
from tandem.parallel.fully_shard.reduction import GradientReduction
from tandem.parallel.fully_shard.unit import unit_of
from tandem.parallel.layout.flat_shard import FlatShard, missing
from tandem.parallel.layout.pieces import per_element, per_flat_element


def over_the_world(model: nn.Module) -> bool:
    """Whether `model` is fully sharded, every unit over the whole world (what a change of
    world can cut again; a subgroup's or a mesh's units cannot follow it)."""
    found = [unit_of(m) for m in model.modules() if unit_of(m) is not None]
    return bool(found) and all(u.group is None and u.replicate is None for u in found)


def reshard_units(model: nn.Module) -> None:
    """Cut every unit of `model` for the world as it is now; the shards hold zeros."""
    found = [unit_of(m) for m in model.modules() if unit_of(m) is not None]
    if any(unit.mesh is not None for unit in found):
        raise ValueError(
            f"this model was sharded by tandem.fsdp.fully_shard, whose DTensor parameters live on "
            f"a DeviceMesh of the old world ({found[0].size} ranks); a change of world cannot cut "
            f"them again. Shard it with td.fully_shard (plain tensor shards) to train elastically")
    for unit in found:
        unit.size, unit.rank = group_size(None), group_rank(None)
        unit.space = FlatShard(unit.numel, unit.size, unit.rank)
        unit.shard_numel = unit.space.shard_numel
        unit.reduction = GradientReduction(unit.size, None, None, unit.policy.reduce_dtype
                                           or unit.policy.param_dtype)
        unit._full, unit._pending, unit._in_flight = None, None, []
        if unit.shard is not None:
            with torch.no_grad():
                unit.shard.data = torch.zeros(unit.shard_numel, dtype=unit.shard.dtype,
                                              device=unit.shard.device)
            unit.shard.grad = None
    for unit in found:
        if unit.is_root:
            unit.is_root = True  # its agreement, made again for the new shards and world


def model_state(model: nn.Module) -> dict[str, Any]:
    """This rank's part of the model: each unit's shard (its real elements, [lo, hi) of the
    unit's flat space) and the model's buffers. A copy; no communication."""
    shards = {}
    for name, unit in units(model):
        lo, hi = unit.my_range()
        shards[name] = (lo, hi, unit.shard.detach()[: hi - lo].clone())
    return {"shards": shards,
            "buffers": {name: b.detach().clone() for name, b in model.named_buffers()}}


def load_model_state(model: nn.Module, held: list[dict[str, Any]]) -> None:
    """Each unit's new shard from the parts in `held` (every rank's `model_state`)."""
    with torch.no_grad():
        for name, unit in units(model):
            lo, hi = unit.my_range()
            unit.shard.zero_()
            for state in held:
                a, b, values = state["shards"][name]
                x, y = max(a, lo), min(b, hi)  # the overlap of its part and this rank's
                if x < y:
                    unit.shard[x - lo: y - lo].copy_(values[x - a: y - a])
        buffers = dict(model.named_buffers())
        for name, value in held[0]["buffers"].items():
            buffers[name].copy_(value)


def _overlap(a: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    x, y = max(a, lo), min(b, hi)
    return (x, y) if x < y else (a, a)


def cut(part: dict[str, Any], model: nn.Module, rank: int) -> dict[str, Any]:
    """`part` ({"model": a `model_state`, "optimizer": `optimizer_shards` or None}) cut to what
    `rank` holds of each unit in the current world: what that rank needs of it."""
    size = group_size(None)
    shards, optimizer = {}, {}
    for name, unit in units(model):
        lo, hi = FlatShard(unit.numel, size, rank).my_range()
        a, b, values = part["model"]["shards"][name]
        x, y = _overlap(a, b, lo, hi)
        shards[name] = (x, y, values[x - a: y - a])
        if part["optimizer"] is not None and name in part["optimizer"]:
            a, b, state = part["optimizer"][name]
            x, y = _overlap(a, b, lo, hi)
            optimizer[name] = (x, y, {
                k: v[x - a: y - a] if per_flat_element(k, v, b - a) else v
                for k, v in state.items()})
    return {"model": {"shards": shards, "buffers": part["model"]["buffers"]},
            "optimizer": optimizer if part["optimizer"] is not None else None}


def _shards(model: nn.Module) -> dict[int, tuple[str, Any]]:
    return {id(unit.shard): (name, unit) for name, unit in units(model)}


def optimizer_shards(optimizer: Any, model: nn.Module) -> dict[str, tuple]:
    """This rank's optimizer state of each unit's shard: unit name -> (lo, hi, its state, the
    per-element tensors cut to [lo, hi) of the unit's flat space)."""
    shards, held = _shards(model), {}
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if id(param) not in shards:
            continue
        name, unit = shards[id(param)]
        lo, hi = unit.my_range()
        held[name] = (lo, hi, {
            k: v.detach()[: hi - lo].clone() if per_element(k, v, param) else copy.deepcopy(v)
            for k, v in optimizer.state.get(param, {}).items()})
    return held


def ranges(state: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The flat range of each unit that a `model_state` holds."""
    return {name: (lo, hi) for name, (lo, hi, _) in state["shards"].items()}


def lost(held: list[dict[str, tuple[int, int]]], model: nn.Module) -> list[str]:
    """The units' flat ranges that none of `held` (the `ranges` of every rank's part) covers."""
    said = []
    for name, unit in units(model):
        holes = missing([where[name] for where in held], unit.numel)
        unit_name = f"unit {name!r}" if name else "the root unit"
        said += [f"{unit_name} elements [{a}, {b})" for a, b in holes]
    return said


def load_optimizer_shards(optimizer: Any, model: nn.Module, held: list[dict[str, tuple]]) -> None:
    """This rank's new part of every unit's optimizer state, from the parts in `held`."""
    shards = _shards(model)
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if id(param) not in shards:
            continue
        name, unit = shards[id(param)]
        pieces = [h[name] for h in held if name in h]
        new: dict[str, Any] = {}
        lo, hi = unit.my_range()
        for a, b, state in pieces:
            for k, v in state.items():
                if not per_flat_element(k, v, b - a):
                    new.setdefault(k, copy.deepcopy(v))
                    continue
                mine = new.setdefault(k, torch.zeros(unit.shard_numel, dtype=v.dtype,
                                                     device=param.device))
                x, y = max(a, lo), min(b, hi)  # the overlap of its part and this rank's
                if x < y:
                    mine[x - lo: y - lo].copy_(v[x - a: y - a])
        if new:
            optimizer.state[param] = new
        else:
            optimizer.state.pop(param, None)
