"""A ZeroOptimizer's state moved between world sizes in memory (td.elastic).

A commit keeps this rank's shard only (`shard_state`: a copy, no communication). After a
change of world the optimizer cuts its flat space for the new size (its owner's `rejoin`), and
every rank receives the shards of the newest commit from the ranks that hold them
(`td.elastic.State` sends each rank the `cut` of every part that it `wanted`) and keeps its
new part (`load_shards`). When no remaining rank holds some
part of the flat space (its only holder left the job), `flat_shard.missing` says which: the
state can then only come from a checkpoint on disk. (`fully_shard/resize.py` does the same
for a fully sharded model's optimizer.)

Under whole sharding (Adafactor, Muon, LAMB: each parameter owned whole by one rank) a part is
the state of the parameters a rank owns, by index; the ranges it covers are those parameters'
places in the natural flat space (end to end, group by group), so `missing` names holes alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tandem.parallel.layout.flat_shard import FlatShard, missing
from tandem.parallel.layout.pieces import per_flat_element


def shard_state(optimizer: Any) -> dict[str, Any]:
    """This rank's part of the state, each group's as a slice of the flat space (whole: each
    owned parameter's state by its index)."""
    inner = optimizer.optimizer.state_dict()
    if optimizer.sharding == "whole":
        starts = [o for offsets in optimizer._natural for o in offsets]
        sizes = [p.numel() for p in optimizer.parameters]
        return {"numel": optimizer.numel, "entries": optimizer.owned_state(),
                "ranges": [(starts[i], starts[i] + sizes[i]) for i in optimizer.owned],
                "param_groups": copy.deepcopy(inner["param_groups"])}
    groups = []
    for g, (view, _) in enumerate(optimizer._views):
        start = optimizer._lo + optimizer._view_starts[g]
        state = {k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                 for k, v in inner["state"].get(g, {}).items()}
        groups.append((start, view.numel(), state))
    return {"numel": optimizer.numel,
            "ranges": [(min(optimizer._lo, optimizer.numel), min(optimizer._hi, optimizer.numel))],
            "groups": groups, "param_groups": copy.deepcopy(inner["param_groups"])}


__all__ = ["cut", "cut_for", "load_shards", "missing", "shard_state", "wanted"]


_per_element = per_flat_element  # the one rule, for state of a flat view of n elements


def wanted(optimizer: Any, rank: int) -> tuple[int, int]:
    """The flat elements [lo, hi) that `rank` holds in the optimizer's current cut."""
    space = FlatShard(optimizer.numel, optimizer._size, rank)
    return min(space.start, optimizer.numel), min(space.start + space.shard_numel,
                                                   optimizer.numel)


def cut_for(optimizer: Any, state: dict[str, Any], rank: int) -> dict[str, Any]:
    """What `rank` needs of `state` (a `shard_state`) in the optimizer's current cut."""
    if "entries" in state:  # whole: the parameters `rank` now owns
        return {**state, "entries": {i: entry for i, entry in state["entries"].items()
                                     if optimizer.owners[i] == rank}}
    return cut(state, *wanted(optimizer, rank))


def cut(state: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """`state` (a `shard_state`) cut to the flat elements [lo, hi): what one rank needs of it."""
    groups = []
    for start, n, held in state["groups"]:
        x, y = max(start, lo), min(start + n, hi)
        x, y = (x, y) if x < y else (start, start)
        groups.append((x, y - x, {k: v[x - start: y - start] if _per_element(k, v, n) else v
                                  for k, v in held.items()}))
    return {**state, "groups": groups}


def load_shards(optimizer: Any, shards: list[dict[str, Any]]) -> None:
    """Assemble the full state from `shards` (which cover the flat space) and keep this rank's
    part of it, in the optimizer's current partition."""
    if optimizer.sharding == "whole":
        entries: dict[int, dict[str, Any]] = {}
        for shard in shards:
            entries.update(shard["entries"])
        groups, index = [], 0
        for group_dict, params in zip(shards[0]["param_groups"], optimizer._params, strict=True):
            groups.append({**group_dict, "params": list(range(index, index + len(params)))})
            index += len(params)
        optimizer.load_state_dict({"state": entries, "param_groups": groups})
        return
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for g, (params, offsets) in enumerate(zip(optimizer._params, optimizer._offsets,
                                              strict=True)):
        start, end = optimizer._group_ranges[g]
        flats: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for shard in shards:
            at, n, held = shard["groups"][g]
            for k, v in held.items():
                if _per_element(k, v, n):
                    flat = flats.setdefault(k, torch.zeros(end - start, dtype=v.dtype,
                                                           device=optimizer._device))
                    flat[at - start: at - start + n].copy_(v)
                else:
                    scalars.setdefault(k, v)
        for p, offset in zip(params, offsets, strict=True):
            if flats or scalars:
                entry = {k: copy.deepcopy(v) for k, v in scalars.items()}
                entry.update({k: flat[offset - start: offset - start + p.numel()].view(p.shape)
                              for k, flat in flats.items()})
                state[index] = entry
            index += 1
    groups, index = [], 0
    for group_dict, params in zip(shards[0]["param_groups"], optimizer._params, strict=True):
        groups.append({**group_dict, "params": list(range(index, index + len(params)))})
        index += len(params)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
