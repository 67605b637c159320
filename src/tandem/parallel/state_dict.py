"""One state API for any split: `td.get_state_dict` and `td.set_state_dict`, shaped like torch's
`torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers,
options=StateDictOptions(full_state_dict=True))`.

    model_state, optim_state = td.get_state_dict(model, optimizer)   # collective, every rank
    ...
    td.set_state_dict(model, optimizer, model_state, optim_state)     # any layout, same model

Whatever splits the model (replicated under DDP / DistributedOptimizer, a ZeroOptimizer,
`td.fully_shard`, tensor parallelism, a `td.Pipeline`, or a mix), the returned state is the
one-process model's: `model_state` its ordinary `state_dict()`, `optim_state` its optimizer's
state keyed by parameter name, as torch's full optimizer state dict is:

    {"state": {"0.weight": {"momentum_buffer": tensor of the parameter's shape, ...}, ...},
     "param_groups": [{"lr": 0.1, ..., "params": ["0.weight", "0.bias", ...]}]}

Both go through the one layout protocol (`parallel/layout/protocol.py`): each rank says which
boxes of which one-process tensors it holds, for the parameters and for the per-element
optimizer state that follows them; `get_state_dict` gathers the boxes (one all-gather over the
world), `set_state_dict` cuts each rank's boxes out of the full tensors. So a state taken in one
layout loads into any other layout of the same model, on any number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.collectives import user as collectives
from tandem.parallel.fully_shard.api import full_state_dict, load_full_state_dict
from tandem.parallel.layout import protocol as layout
from tandem.parallel.layout.owner import owner_of
from tandem.parallel.layout.pieces import per_element, per_element_of_shape

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(model: nn.Module | Any, optimizer: Any = None, *,
                   full: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The one-process state of a split model and its optimizer, on every rank (collective).

    Args:
        model: the model as this rank holds it: an `nn.Module` (plain, wrapped by
            `td.DistributedDataParallel`, `td.fully_shard`ed, `td.parallelize`d, or a mix) or a
            `td.Pipeline`.
        optimizer: the optimizer that steps it (a torch optimizer, `td.DistributedOptimizer`,
            `td.ZeroOptimizer`), or None for the model alone.
        full: True (the only form so far) for the one-process state on every rank; per-rank
            pieces are what `td.checkpoint.save_sharded` writes.

    Returns:
        `(model_state, optimizer_state)`: the unsplit model's `state_dict()`, and the
        optimizer's state keyed by parameter name (`{"state": {name: {key: value}},
        "param_groups": [{..., "params": [names]}]}`; None without an optimizer). Per-element
        state (momentum, Adam's moments) has its parameter's one-process shape.

    Raises:
        ValueError: `full=False`; an optimizer over parameters that are not the model's; a
            `td.LocalSGD` optimizer (every rank holds its own state between averagings).
        TypeError: a model that is neither an `nn.Module` nor a `td.Pipeline`, or an optimizer
            that is not a torch optimizer nor one of tandem's wrappers.
        CollectiveMismatchError: a rank did not call it, or called it with another split.
    """
    if not full:
        raise ValueError("td.get_state_dict(full=False) is not offered: for each rank's own pieces, "
                         "save them with td.checkpoint.save_sharded(path, model=model, "
                         "optimizer=optimizer) (any layout loads them back)")
    model_state = full_state_dict(model)
    if optimizer is None:
        return model_state, None
    return model_state, _full_optimizer_state(optimizer, model)


def set_state_dict(model: nn.Module | Any, optimizer: Any, model_state: dict[str, torch.Tensor],
                   optimizer_state: dict[str, Any] | None = None) -> None:
    """Load one-process state into a split model and its optimizer: each rank keeps its part.

    The state may come from `td.get_state_dict` in any layout and world size, or from one
    process (`model.state_dict()`; the optimizer's state keyed by parameter name).

    Args:
        model: the model as this rank holds it (see `get_state_dict`).
        optimizer: its optimizer, or None to load the model alone.
        model_state: the unsplit model's state dict.
        optimizer_state: the optimizer's state keyed by parameter name, as `get_state_dict`
            returns it; None loads the model alone.

    Returns:
        None; the model's parameters and buffers and the optimizer's state are overwritten.

    Raises:
        ValueError: a state dict for another model (the missing, unexpected and reshaped names
            listed), or an optimizer state that lacks one of this rank's parameters.
        TypeError: as `get_state_dict`.
    """
    owner = owner_of(model)
    if not owner.load_own_state(model_state):  # a pipeline's stage takes its own entries
        load_full_state_dict(model, model_state)
    if optimizer is not None and optimizer_state is not None:
        _load_optimizer(optimizer, model, optimizer_state)


# -- the optimizer --------------------------------------------------------------------------------


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _full_optimizer_state(optimizer: Any, model: Any) -> dict[str, Any]:
    """Gather every rank's boxes of per-element state (one all-gather over the world)."""
    inner, params = layout.optimizer_params(optimizer, [model])
    boxes: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
    scalars: dict[str, dict[str, Any]] = {}
    for p, placements in params:
        for key, value in inner.state.get(p, {}).items():
            if per_element(key, value, p):
                for placement in placements:
                    for chunk in placement.chunks:
                        boxes.append((placement.name, key, placement.shape, chunk.offsets,
                                      chunk.sizes, chunk.view(value).detach().cpu().clone()))
            else:
                for placement in placements:
                    if placement.chunks:
                        scalars.setdefault(placement.name, {})[key] = (
                            value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value)
    names_of = {id(p): [pl.name for pl in placements if pl.chunks] for p, placements in params}
    groups = [(_hyper(g), [n for p in g["params"] for n in names_of.get(id(p), [])])
              for g in inner.param_groups]
    device = next((p.device for p, _ in params), torch.device("cpu"))
    state: dict[str, dict[str, Any]] = {}
    merged: dict[tuple[int, str], tuple[dict[str, Any], list[str]]] = {}
    mine = (boxes, scalars, groups)
    # one process without td.init holds everything already
    everyone = collectives.allgather_object(mine) if runtime.is_initialized() else [mine]
    for rank_boxes, rank_scalars, rank_groups in everyone:
        for name, key, shape, offsets, sizes, value in rank_boxes:
            entry = state.setdefault(name, {})
            if key not in entry:
                entry[key] = torch.zeros(shape, dtype=value.dtype, device=device)
            entry[key][_region(offsets, sizes)] = value.to(device)
        for name, values in rank_scalars.items():
            for key, value in values.items():
                state.setdefault(name, {}).setdefault(
                    key, value.to(device) if isinstance(value, torch.Tensor) and value.dim() else value)
        for i, (hyper, names) in enumerate(rank_groups):
            _merge_group(merged, i, hyper, names)
    return {"state": state, "param_groups": [{**hyper, "params": names} for hyper, names in merged.values()]}


def _region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    """The box as an index of the one-process tensor."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def _merge_group(merged: dict[tuple[int, str], tuple[dict[str, Any], list[str]]], i: int,
                 hyper: dict[str, Any], names: list[str]) -> None:
    """Group i of one rank and group i of another are one group when their settings are equal
    (replicas, shards and pipeline stages of one optimizer); otherwise each is its own."""
    _, held = merged.setdefault((i, repr(sorted(hyper.items()))), (hyper, []))
    held.extend(n for n in names if n not in held)


def _load_optimizer(optimizer: Any, model: Any, saved: dict[str, Any]) -> None:
    """Cut this rank's boxes of each per-element state out of the full tensors, then load the
    wrapped torch optimizer's own state dict (torch casts to each parameter's dtype and device)."""
    inner, params = layout.optimizer_params(optimizer, [model])
    state: dict[int, dict[str, Any]] = {}
    first_name: dict[int, str] = {}
    for i, (p, placements) in enumerate(params):
        names = [pl.name for pl in placements if pl.chunks]
        if names:
            first_name[i] = names[0]
        held = [pl for pl in placements if pl.chunks and pl.name in saved["state"]]
        if not held:
            if any(pl.chunks for pl in placements) and saved["state"]:
                raise ValueError(f"the optimizer state has no entry for {', '.join(names)}, held by "
                                 f"this rank: was it taken from another model or optimizer?")
            continue
        entry: dict[str, Any] = {}
        for key, value in saved["state"][held[0].name].items():
            if per_element_of_shape(key, value, held[0].shape):
                local = torch.zeros(p.shape, dtype=value.dtype, device=p.device)
                for placement in held:
                    full = saved["state"][placement.name][key]
                    for chunk in placement.chunks:
                        chunk.view(local).copy_(full[_region(chunk.offsets, chunk.sizes)])
                entry[key] = local
            else:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[i] = entry
    group_of = {name: group for group in saved["param_groups"] for name in group["params"]}
    groups, at = [], 0
    for g in inner.param_groups:
        hyper = _hyper(g)
        for i in range(at, at + len(g["params"])):
            if first_name.get(i) in group_of:
                hyper = _hyper(group_of[first_name[i]])
                break
        groups.append({**hyper, "params": list(range(at, at + len(g["params"])))})
        at += len(g["params"])
    inner.load_state_dict({"state": state, "param_groups": groups})
