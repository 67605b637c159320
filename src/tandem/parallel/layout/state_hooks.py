"""`model.state_dict()` and `model.load_state_dict()` of a split model speak the one-process model.

PyTorch's own idiom, `torch.save(model.state_dict(), ...)` then `model.load_state_dict(...)`,
must not silently save or load one rank's piece. So every module that tandem splits (a
fully_shard unit, a tensor-parallel layer) gets two hooks:

- after `state_dict()`: its local entries (a unit's flat `_tandem_shard`, a layer's slices)
  are replaced by the whole one-process tensors under their one-process names, gathered over
  the module's group. It is a collective, as FSDP's full state dict is: every rank of the
  group calls `model.state_dict()` (tandem's step check names a rank that does not);
- before `load_state_dict()`: one-process entries for the module are cut into this rank's
  piece (the boxes `parallel/layout/protocol.py` describes), so a state dict saved from the plain model
  loads into the split one on any number of ranks. A dict that holds the local entries
  themselves loads as before.

tandem's own walkers (layout, checkpoints) read the local tensors directly, never through
`state_dict()`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def install(module: nn.Module, split: Any = None) -> None:
    """Give `module` the two hooks; `split` (default: the module) implements the layout
    protocol of `parallel/layout/pieces.py` (`local_pieces`, `full_tensors`) for what it splits."""
    split = module if split is None else split
    module.register_state_dict_post_hook(
        lambda module, state, prefix, metadata: _to_full(module, split, state, prefix))
    module.register_load_state_dict_pre_hook(
        lambda module, state, prefix, *rest: _to_local(module, split, state, prefix))


def _local_key(module: nn.Module, tensor: torch.Tensor) -> str:
    return next(name for name, p in module._parameters.items() if p is tensor)


def _to_full(module: nn.Module, split: Any, state: dict, prefix: str) -> None:
    for held in split.local_pieces(prefix):
        state.pop(prefix + _local_key(module, held.tensor), None)
    state.update(split.full_tensors(prefix))


def _to_local(module: nn.Module, split: Any, state: dict, prefix: str) -> None:
    for held in split.local_pieces(prefix):
        names = [p.name for p in held.placements]
        if not all(name in state for name in names):
            continue  # local entries, or a partial dict: torch's own checks report it
        if any(tuple(state[p.name].shape) != p.shape for p in held.placements):
            continue  # torch's size-mismatch error names it
        local = torch.zeros_like(held.tensor.detach())
        for placement in held.placements:
            full = state.pop(placement.name)
            for chunk in placement.chunks:
                box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
                chunk.view(local).copy_(full[box])
        state[prefix + _local_key(module, held.tensor)] = local
