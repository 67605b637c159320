"""What each rank holds of a split model: the one protocol behind checkpoints and model-wide calls.

Every way tandem splits a model keeps, on each rank, some *local tensors* (a parameter, a
buffer, a fully sharded unit's flat shard, a tensor-parallel slice, a pipeline stage's
layers). Each local tensor holds pieces of one or more *one-process tensors* (the tensors of
the model's ordinary, unsplit `state_dict()`), described by a `Placement`: the one-process
name and shape, and the boxes (`Chunk`s) this rank holds, each contiguous inside the local
tensor. One description covers every layout:

    replicated (DDP, DistributedOptimizer)  one chunk: the whole tensor, on every rank
    sliced on a dim (tensor parallelism)     one chunk: rows or columns of it (attention's
                                             q/k/v rows: three chunks of one local tensor)
    flat shard (fully_shard, ZeRO)           a range of the flattened tensor, cut into
                                             the few boxes that are contiguous in row-major order
    owned by a stage (Pipeline)              the whole tensor on its stage, nothing elsewhere

Each module that tandem splits implements the protocol of `parallel/layout/pieces.py`
(`local_pieces(prefix)`, `full_tensors(prefix)`): a tensor-parallel layer itself, a fully_shard
unit through `UnitPieces`; `split_of_module` finds it. Every model and optimizer has an owner
(`parallel/layout/owner.py`): a `td.Pipeline`'s is its stage under the whole model's names.
`held(model)` lists a model's local tensors with their placements, whatever wraps it;
`optimizer_params(optimizer, models)` does the same for per-element optimizer state, which
follows its parameter's layout (ZeroOptimizer's owner gives its flat shards or whole
parameters).
`parallel/layout/splits.py` records, per tensor, how it is split and over which group, for the calls
that reduce or broadcast (clipping, `broadcast_parameters`, the reducer).

The distributed checkpoint (`tandem.checkpoint.sharded`) writes and reads exactly these
boxes, so a checkpoint saved in one layout loads into any other: each rank reads, from
whichever files hold them, the boxes it now owns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tandem.parallel.layout.owner import (
    Params,
    local_state,
    own_held,
    owner_of,
    split_of_module,
)
from tandem.parallel.layout.pieces import Chunk, Held, Placement, flat_placements, per_element, whole

__all__ = ["Chunk", "Held", "Params", "Placement", "flat_placements", "held",
           "innermost_optimizer", "iter_chunks", "local_state", "optimizer_params", "own_held",
           "per_element", "split_kinds", "split_of_module", "whole"]


def held(model: Any) -> list[Held]:
    """Every local tensor of `model` in its state dict, with the one-process pieces it holds.

    `model` is an `nn.Module` (plain, data parallel, fully sharded, tensor parallel, or a mix
    of these) or a `td.Pipeline` (this rank's stage, under the whole model's names): its owner
    (`parallel/layout/owner.py`) answers.
    """
    return owner_of(model).held()


def split_kinds(model: Any) -> set[str]:
    """How `model` is split, as names: 'fully_shard', 'tensor parallel', 'pipeline' (empty: whole)."""
    return owner_of(model).split_kinds()


# -- optimizer state ------------------------------------------------------------------------------


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under tandem's wrappers; None when `optimizer` is not one."""
    return owner_of(optimizer).optimizer()


def optimizer_params(optimizer: Any, models: Iterable[Any]) -> tuple[Any, Params]:
    """(the torch optimizer that holds the state, [(each of its parameters in order, the
    one-process pieces it holds)]) — per-element state follows its parameter's pieces."""
    owner = owner_of(optimizer)
    refusal = owner.checkpoint_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    placements: dict[int, tuple[Placement, ...]] = {}
    for model in models:
        for h in held(model):
            placements[id(h.tensor)] = h.placements
    return owner.optimizer(), owner.state_placements(placements)


def iter_chunks(h: Held) -> Iterator[tuple[Placement, Chunk]]:
    for placement in h.placements:
        for chunk in placement.chunks:
            yield placement, chunk
