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
unit through `UnitPieces`; `split_of_module` finds it, and a `td.Pipeline` is its stage under
the whole model's names. `held(model)` lists a model's local tensors with their placements,
whatever wraps it; `optimizer_params(optimizer, models)` does the same for per-element
optimizer state, which follows its parameter's layout (ZeroOptimizer's flat shards or whole
parameters too, as `ZeroOptimizer.state_placements` describes them).
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
from torch import nn

from tandem.parallel.fully_shard.pieces import UnitPieces
from tandem.parallel.fully_shard.unit import SHARD, unit_of
from tandem.parallel.layout.pieces import Chunk, Held, Placement, flat_placements, per_element, whole

__all__ = ["Chunk", "Held", "Placement", "flat_placements", "held", "innermost_optimizer",
           "iter_chunks", "local_state", "optimizer_params", "own_held", "per_element",
           "split_kinds", "split_of_module", "whole"]


def split_of_module(module: nn.Module) -> Any:
    """The object that implements the layout protocol (`local_pieces`, `full_tensors`) for what
    `module` itself splits: its fully_shard unit, or the module (a tensor-parallel layer)."""
    unit = unit_of(module)
    if unit is not None and unit.shard is not None:
        return UnitPieces(unit)
    if hasattr(module, "local_pieces") and hasattr(module, "full_tensors"):
        return module
    return None


def held(model: Any) -> list[Held]:
    """Every local tensor of `model` in its state dict, with the one-process pieces it holds.

    `model` is an `nn.Module` (plain, data parallel, fully sharded, tensor parallel, or a mix
    of these) or a `td.Pipeline` (this rank's stage, under the whole model's names).
    """
    from tandem.parallel.pipeline.stage import Pipeline

    if isinstance(model, Pipeline):
        return _module_held(model.stage, model._prefix)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module or a td.Pipeline, got {type(model).__name__}")
    return _module_held(model, "")


def own_held(module: nn.Module, prefix: str) -> list[Held]:
    """The local tensors that `module` itself splits, under one-process names after `prefix`."""
    split = split_of_module(module)
    return [] if split is None else split.local_pieces(prefix)


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `model.state_dict(keep_vars=True)` holds before tandem's hooks make it the
    one-process state dict: the parameters and persistent buffers this rank keeps."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, param in module._parameters.items():
            if param is not None:
                out[prefix + key] = param
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                out[prefix + key] = buffer
    return out


def _module_held(model: nn.Module, base: str) -> list[Held]:
    out: list[Held] = []
    special: set[int] = set()
    for name, module in model.named_modules():
        pieces = own_held(module, f"{base}{name}." if name else base)
        out.extend(pieces)
        special.update(id(h.tensor) for h in pieces)
    for key, tensor in local_state(model).items():
        if id(tensor) in special or key.split(".")[-1] == SHARD:
            continue
        out.append(Held(tensor, (whole(base + key, tensor),)))
    return out


def split_kinds(model: Any) -> set[str]:
    """How `model` is split, as names: 'fully_shard', 'tensor parallel', 'pipeline' (empty: whole)."""
    from tandem.parallel.pipeline.stage import Pipeline

    if isinstance(model, Pipeline):
        return {"pipeline"} | split_kinds(model.stage)
    kinds = set()
    if isinstance(model, nn.Module):
        for module in model.modules():
            if unit_of(module) is not None:
                kinds.add("fully_shard")
            elif split_of_module(module) is not None:
                kinds.add("tensor parallel")
    return kinds


# -- optimizer state ------------------------------------------------------------------------------


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under tandem's wrappers (DistributedOptimizer, LocalSGD and
    ZeroOptimizer keep it as `.optimizer`); None when `optimizer` is not one."""
    from tandem.parallel.data_parallel.local_sgd import LocalSGD
    from tandem.parallel.data_parallel.wrappers import DistributedOptimizer
    from tandem.parallel.zero.optimizer import ZeroOptimizer

    while isinstance(optimizer, (DistributedOptimizer, LocalSGD, ZeroOptimizer)):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


Params = list[tuple[torch.Tensor, tuple[Placement, ...]]]


def optimizer_params(optimizer: Any, models: Iterable[Any]) -> tuple[Any, Params]:
    """(the torch optimizer that holds the state, [(each of its parameters in order, the
    one-process pieces it holds)]) — per-element state follows its parameter's pieces."""
    from tandem.parallel.data_parallel.local_sgd import LocalSGD
    from tandem.parallel.zero.optimizer import ZeroOptimizer

    placements: dict[int, tuple[Placement, ...]] = {}
    for model in models:
        for h in held(model):
            placements[id(h.tensor)] = h.placements
    if isinstance(optimizer, LocalSGD):
        raise ValueError(
            "a td.LocalSGD run cannot be checkpointed with td.Checkpointer / td.save_sharded: "
            "between its averagings every rank holds its own parameters and optimizer state, "
            "and a checkpoint keeps one copy of each tensor, so a restored run would go on from "
            "one replica (another run). Save every rank's own state instead, e.g. "
            "torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict()}, "
            "f'ckpt-rank{td.rank()}.pt'), and load it on the same number of ranks")
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.optimizer, optimizer.state_placements(placements)
    inner = innermost_optimizer(optimizer)
    if inner is None:
        raise TypeError(f"expected a torch optimizer or one of tandem's wrappers, got "
                        f"{type(optimizer).__name__}")
    out = []
    for i, p in enumerate(q for g in inner.param_groups for q in g["params"]):
        if id(p) not in placements:
            raise ValueError(
                f"optimizer parameter {i} {tuple(p.shape)} is not a parameter of the model(s) "
                f"saved with it: pass the model the optimizer steps (after td.fully_shard or "
                f"td.parallelize, build the optimizer over model.parameters() again)")
        out.append((p, placements[id(p)]))
    return inner, out


def iter_chunks(h: Held) -> Iterator[tuple[Placement, Chunk]]:
    for placement in h.placements:
        for chunk in placement.chunks:
            yield placement, chunk
