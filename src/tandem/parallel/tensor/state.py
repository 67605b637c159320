"""TP-sharded checkpoints, minimal: consolidate to a full state dict on save, reshard on load.

`full_state_dict(model)` all-gathers every sharded parameter over its tp group, so the result
has the keys and shapes of the one-process model (the attention's q/k/v/out keep their names
under the converted module); `load_full_state_dict(model, state)` slices a full state dict for
this rank, so a checkpoint written at one tp loads at any other tp (or into the plain model).
Written with `td.save` by rank 0 like any state dict.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tandem.comm import collectives
from tandem.comm.groups import Group, group_rank, group_size
from tandem.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def sharded_parameters(model: nn.Module) -> dict[str, tuple[int, Group | None]]:
    """`{state-dict key: (split dim, tp group)}` of every tensor-parallel parameter of `model`."""
    found = {}
    for prefix, module in model.named_modules():
        dims = {}
        if isinstance(module, RowParallelLinear):
            dims = {"weight": 1}
        elif isinstance(module, ColumnParallelLinear):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, VocabParallelEmbedding):
            dims = {"weight": 0}
        for name, dim in dims.items():
            if getattr(module, name, None) is not None and group_size(module.group) > 1:
                found[f"{prefix}.{name}" if prefix else name] = (dim, module.group)
    return found


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The one-process state dict of a tensor-parallel model; every tp rank must call it."""
    shards = sharded_parameters(model)
    state = {}
    for key, value in model.state_dict().items():
        if key in shards:
            dim, group = shards[key]
            gathered = collectives.allgather(value.detach().movedim(dim, 0).contiguous(), group=group)
            value = gathered.movedim(0, dim)
        state[key] = value.detach().clone()
    return state


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a one-process state dict into a tensor-parallel model of any tp: each rank takes its slice."""
    shards = sharded_parameters(model)
    local = {}
    for key, value in state.items():
        if key in shards:
            dim, group = shards[key]
            value = value.chunk(group_size(group), dim=dim)[group_rank(group)]
        local[key] = value
    return model.load_state_dict(local, strict=strict)
