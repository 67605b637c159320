"""Pieces of one-process tensors held by a rank: the vocabulary of tandem's one layout protocol.

A *one-process tensor* is an entry of the model's ordinary, unsplit `state_dict()`. A rank keeps
*local tensors* (a parameter, a fully sharded unit's flat shard, a tensor-parallel slice); each
holds boxes (`Chunk`s) of one or more one-process tensors, described by a `Placement`. Every
module that tandem splits implements two methods in these terms (see `parallel/layout/protocol.py`):

    split.local_pieces(prefix) -> list[Held]           what this rank holds, under one-process names
    split.full_tensors(prefix) -> dict[str, Tensor]    the one-process tensors, gathered (collective)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


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


def sliced(name: str, local: torch.Tensor, full: tuple[int, ...], first: int, dim: int = 0) -> Placement:
    """A local tensor that is the slice [first, first + its size) of dimension `dim`."""
    offsets = [0] * len(full)
    offsets[dim] = first
    return Placement(name, full, (Chunk(tuple(offsets), tuple(local.shape), 0),))


def per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """Optimizer state with one value per parameter element (momentum, Adam's moments), not a
    scalar such as Adam's step: the one rule every optimizer-state walker uses (checkpoints,
    ZeroOptimizer's shards, fully_shard's full optimizer state)."""
    return per_element_of_shape(key, value, tuple(param.shape))


def per_element_of_shape(key: str, value: Any, shape: tuple[int, ...]) -> bool:
    """`per_element` for a parameter of `shape` that is not at hand (a saved one-process
    parameter's placement, a flat range): the same rule, not a copy of it."""
    return isinstance(value, torch.Tensor) and per_element_shapes(key, tuple(value.shape), shape)


def per_element_shapes(key: str, value_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """The rule itself, on shapes alone: state `key` of `value_shape` for a parameter of `shape`
    (a value that is not at hand: a checkpoint's saved shape, a box another rank holds). A
    0-dim parameter's state is per element too, except its "step"."""
    return tuple(value_shape) == tuple(shape) and (len(shape) > 0 or key != "step")


def per_flat_element(key: str, value: Any, n: int) -> bool:
    """`per_element` for the state of a flat 1-D view of `n` elements (a ZeroOptimizer's or a
    fully_shard unit's range [lo, lo + n) of its flat space)."""
    return per_element_of_shape(key, value, (n,))
