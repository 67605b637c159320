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

`held(model)` lists a model's local tensors with their placements, whatever wraps it;
`optimizer_held(optimizer, model)` does the same for per-element optimizer state, which
follows its parameter's layout. The distributed checkpoint (`tandem.sharded_checkpoint`)
writes and reads exactly these boxes, so a checkpoint saved in one layout loads into any
other: each rank reads, from whichever files hold them, the boxes it now owns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from tandem.comm.groups import Group, group_rank, group_size
from tandem.parallel.fully_shard.unit import ATTR, SHARD
from tandem.parallel.tensor.attention import ParallelSelfAttention
from tandem.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class Chunk:
    """A box of a one-process tensor, held contiguously from element `start` of a local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The box inside `local` (a view: writing to it writes the local tensor)."""
        return local.reshape(-1)[self.start : self.start + self.numel].view(self.sizes)


@dataclass(frozen=True)
class Placement:
    """What this rank holds of the one-process tensor `name` (of `shape`)."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    def renamed(self, name: str) -> Placement:
        return Placement(name, self.shape, self.chunks)


class Held(NamedTuple):
    """One local tensor and the pieces of one-process tensors it holds."""

    tensor: torch.Tensor
    placements: tuple[Placement, ...]


def whole(name: str, tensor: torch.Tensor) -> Placement:
    """A tensor this rank holds entirely (replicated, or owned by this pipeline stage)."""
    shape = tuple(tensor.shape)
    return Placement(name, shape, (Chunk((0,) * len(shape), shape, 0),))


def flat_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) that make up elements [lo, hi) of a row-major `shape`, each
    contiguous in that order: at most two partial rows per dimension plus one block of rows."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if lo % inner:  # a partial first row
        row = lo // inner
        end = min(hi, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(lo - row * inner, end - row * inner, rest)]
        lo = end
    rows = (hi - lo) // inner
    if rows:
        boxes.append(((lo // inner, *(0,) * len(rest)), (rows, *rest)))
        lo += rows * inner
    if lo < hi:  # a partial last row
        row = lo // inner
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(0, hi - row * inner, rest)]
    return boxes


def flat_placements(names: Iterable[str], shapes: Iterable[tuple[int, ...]], lo: int, hi: int,
                    base: int = 0) -> tuple[Placement, ...]:
    """Placements of tensors laid end to end in a flat space (from element `base`), of which a
    local tensor holds elements [lo, hi) (fully_shard's units, ZeroOptimizer's shards)."""
    out = []
    offset = base
    for name, shape in zip(names, shapes, strict=True):
        n = math.prod(shape)
        a, b = max(lo, offset), min(hi, offset + n)
        chunks = []
        start = a - lo
        for offsets, sizes in flat_boxes(a - offset, b - offset, tuple(shape)):
            chunks.append(Chunk(offsets, sizes, start))
            start += math.prod(sizes)
        out.append(Placement(name, tuple(shape), tuple(chunks)))
        offset += n
    return tuple(out)


# -- the layouts of tandem's wrappers -----------------------------------------------------------


def _rows(name: str, local: torch.Tensor, full: tuple[int, ...], first: int, dim: int = 0) -> Placement:
    """A local tensor that is the slice [first, first + its size) of dimension `dim`."""
    offsets = [0] * len(full)
    offsets[dim] = first
    return Placement(name, full, (Chunk(tuple(offsets), tuple(local.shape), 0),))


def _column(layer: ColumnParallelLinear, prefix: str) -> list[Held]:
    first = layer.weight.shape[0] * group_rank(layer.group)
    out = [Held(layer.weight, (_rows(prefix + "weight", layer.weight,
                                     (layer.out_features, layer.in_features), first),))]
    if layer.bias is not None:
        out.append(Held(layer.bias, (_rows(prefix + "bias", layer.bias, (layer.out_features,), first),)))
    return out


def _row(layer: RowParallelLinear, prefix: str) -> list[Held]:
    first = layer.weight.shape[1] * group_rank(layer.group)
    out = [Held(layer.weight, (_rows(prefix + "weight", layer.weight,
                                     (layer.out_features, layer.in_features), first, dim=1),))]
    if layer.bias is not None:
        out.append(Held(layer.bias, (whole(prefix + "bias", layer.bias),)))
    return out


def _embedding(layer: VocabParallelEmbedding, prefix: str) -> list[Held]:
    full = (layer.num_embeddings, layer.embedding_dim)
    return [Held(layer.weight, (_rows(prefix + "weight", layer.weight, full, layer.start),))]


def _attention(layer: ParallelSelfAttention, prefix: str) -> list[Held]:
    """nn.MultiheadAttention's names; in_proj holds this rank's rows of q, k and v, stacked."""
    e, part = layer.embed_dim, layer.local_heads * layer.head_dim
    first = part * group_rank(layer.group)

    def stacked(name: str, local: torch.Tensor) -> Held:
        inner = math.prod(local.shape[1:])
        chunks = tuple(Chunk((i * e + first, *(0,) * (local.dim() - 1)), (part, *local.shape[1:]),
                             i * part * inner) for i in range(3))
        return Held(local, (Placement(prefix + name, (3 * e, *local.shape[1:]), chunks),))

    out = [stacked("in_proj_weight", layer.in_proj_weight)]
    if layer.in_proj_bias is not None:
        out.append(stacked("in_proj_bias", layer.in_proj_bias))
    out.append(Held(layer.out_weight, (_rows(prefix + "out_proj.weight", layer.out_weight, (e, e),
                                             first, dim=1),)))
    if layer.out_bias is not None:
        out.append(Held(layer.out_bias, (whole(prefix + "out_proj.bias", layer.out_bias),)))
    return out


_TENSOR_PARALLEL = {ColumnParallelLinear: _column, RowParallelLinear: _row,
                    VocabParallelEmbedding: _embedding, ParallelSelfAttention: _attention}


def _unit(unit: Any, prefix: str, module: nn.Module) -> Held:
    parallel = [type(m).__name__ for m in module.modules() if type(m) in _TENSOR_PARALLEL]
    if parallel:
        raise NotImplementedError(
            f"fully_shard of a tensor-parallel module ({prefix or 'the root'} holds "
            f"{parallel[0]}): its shards would mix the ranks' slices. Shard across the dp "
            f"group of a td.mesh and keep tensor-parallel layers outside fully_shard units")
    lo, hi = unit.my_range()
    names = [prefix + n for n in unit.names]
    return Held(unit.shard, flat_placements(names, unit.shapes, lo, hi))


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
    """The local tensors that `module` itself splits (its fully_shard unit's shard, or its
    tensor-parallel slices), under one-process names starting with `prefix`."""
    out = []
    unit = getattr(module, ATTR, None)
    if unit is not None and unit.shard is not None:
        out.append(_unit(unit, prefix, module))
    layout = _TENSOR_PARALLEL.get(type(module))
    if layout is not None:
        out.extend(layout(module, prefix))
    return out


def own_full(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The one-process tensors that `module` itself splits, gathered (collective over its group)."""
    from tandem.comm import collectives

    unit = getattr(module, ATTR, None)
    if unit is not None and unit.shard is not None:
        shard = unit.shard.detach()
        flat = collectives.allgather(shard, group=unit.group) if unit.size > 1 else shard
        out, offset = {}, 0
        for name, shape in zip(unit.names, unit.shapes, strict=True):
            n = math.prod(shape)
            out[prefix + name] = flat[offset : offset + n].view(shape).clone()
            offset += n
        return out
    if type(module) in _TENSOR_PARALLEL:
        return {prefix + name: value for name, value in module.full_weights().items()}
    return {}


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
            if getattr(module, ATTR, None) is not None:
                kinds.add("fully_shard")
            if type(module) in _TENSOR_PARALLEL:
                kinds.add("tensor parallel")
    return kinds


def tensor_parallel_groups(model: nn.Module) -> list[Group | None]:
    """The groups over which `model`'s tensor-parallel layers are split (distinct, in order)."""
    groups: list[Group | None] = []
    for module in model.modules():
        if type(module) in _TENSOR_PARALLEL and group_size(module.group) > 1:
            if all(module.group is not g for g in groups):
                groups.append(module.group)
    return groups


# -- optimizer state ------------------------------------------------------------------------------


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under tandem's wrappers (DistributedOptimizer, LocalSGD and
    ZeroOptimizer keep it as `.optimizer`); None when `optimizer` is not one."""
    from tandem.parallel.data_parallel import DistributedOptimizer
    from tandem.parallel.local_sgd import LocalSGD
    from tandem.parallel.zero import ZeroOptimizer

    while isinstance(optimizer, (DistributedOptimizer, LocalSGD, ZeroOptimizer)):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


Params = list[tuple[torch.Tensor, tuple[Placement, ...]]]


def optimizer_params(optimizer: Any, models: Iterable[Any]) -> tuple[Any, Params]:
    """(the torch optimizer that holds the state, [(each of its parameters in order, the
    one-process pieces it holds)]) — per-element state follows its parameter's pieces."""
    from tandem.parallel.local_sgd import LocalSGD
    from tandem.parallel.zero import ZeroOptimizer

    placements: dict[int, tuple[Placement, ...]] = {}
    for model in models:
        for h in held(model):
            placements[id(h.tensor)] = h.placements
    while isinstance(optimizer, LocalSGD):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.optimizer, _zero_params(optimizer, placements)
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


def _zero_params(zero: Any, placements: dict[int, tuple[Placement, ...]]) -> list:
    """ZeroOptimizer steps one view of its flat shard per param group: each view holds a range
    of the flat space in which the model's parameters lie end to end."""
    out = []
    for views, params, (start, _) in zip(zero._views, zero._params, zero._group_ranges, strict=True):
        view = views[0]
        names, shapes = [], []
        for p in params:
            whole_piece = placements.get(id(p))
            if whole_piece is None or len(whole_piece) != 1 or whole_piece[0].chunks[0].numel != p.numel():
                raise ValueError("ZeroOptimizer over parameters that are themselves split (a "
                                 "shard or a tensor-parallel slice) cannot be checkpointed")
            names.append(whole_piece[0].name)
            shapes.append(whole_piece[0].shape)
        lo = zero._lo + zero._view_starts[len(out)]
        out.append((view, flat_placements(names, shapes, lo, lo + view.numel(), base=start)))
    return out


def per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """Optimizer state with one value per parameter element (momentum, Adam's moments), not a
    scalar such as Adam's step: the one rule every optimizer-state walker uses."""
    return (isinstance(value, torch.Tensor) and value.shape == param.shape
            and (param.dim() > 0 or key != "step"))


def iter_chunks(h: Held) -> Iterator[tuple[Placement, Chunk]]:
    for placement in h.placements:
        for chunk in placement.chunks:
            yield placement, chunk
