"""A fully sharded model cut again for a new world (td.elastic).

After a change of world every unit of the model is cut for the new size (`reshard_units`):
each shard keeps its `nn.Parameter` (the optimizer's), which gets its new size, zeros until
`td.elastic.State` fills it, and the optimizer's state, from the boxes of the one-process
tensors that the ranks held at the commit (`parallel/layout/state_pieces.py`, the path a
checkpoint takes too). `lost` says in the units' terms what no remaining rank holds (a rank
that left took it: a checkpoint on disk is then the only source).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.comm.groups import group_rank, group_size
from tandem.parallel.fully_shard.api import units
from tandem.parallel.fully_shard.reduction import GradientReduction
from tandem.parallel.fully_shard.unit import unit_of
from tandem.parallel.layout.flat_shard import FlatShard


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


def lost(model: nn.Module, holes: dict[str, list[tuple[int, int]]]) -> list[str]:
    """Where `holes` (elements [a, b), row-major, of one-process tensors, by name) lie in the
    units' flat spaces, in words ("unit '0' elements [0, 40)"): what a lost rank took."""
    said = []
    for name, unit in units(model):
        offset, spans = 0, []
        for tensor, shape in zip(unit.names, unit.shapes, strict=True):
            full = f"{name}.{tensor}" if name else tensor
            spans += [(offset + a, offset + b) for a, b in holes.get(full, ())]
            offset += math.prod(shape)
        merged: list[tuple[int, int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        unit_name = f"unit {name!r}" if name else "the root unit"
        said += [f"{unit_name} elements [{a}, {b})" for a, b in merged]
    return said
