"""State as boxes of one-process tensors, from any layout into any other: the one resharding path.

A checkpoint (`tandem.checkpoint.sharded`) and a change of world (`td.elastic`) move state the
same way. Each rank says what it holds, through the owners (`owner.py`): the boxes of each
one-process tensor and the local tensors behind them (`model_pieces`, `optimizer_pieces`). The
new layout says what it needs the same way (`Targets`; optimizer state is made from what the
holders list), and each box needed is filled from the held boxes that meet it: through files
for a checkpoint (DCP's reader intersects them), over the wire for td.elastic (`cut` here,
`elastic/transfer.py`). Per element or not: the one rule, `pieces.per_element`.

Keys follow torch's own conventions (the DCP files use them as they are):

    <model>.<name>                      the one-process state dict (`model.fc.weight`)
    <optimizer>.state.<name>.<key>      per-parameter optimizer state (`optimizer.state.fc.weight.exp_avg`)
    <optimizer>.param_groups            hyper-parameters (a value, not a tensor)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.parallel.layout import protocol as layout
from tandem.parallel.layout.owner import Params, owner_of
from tandem.parallel.layout.pieces import Chunk, per_element, per_element_shapes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a one-process tensor


@dataclass
class Piece:
    """What this rank holds of one one-process tensor: its boxes, each inside a local tensor."""

    key: str
    shape: tuple[int, ...]
    chunks: list[tuple[Chunk, torch.Tensor]] = field(default_factory=list)  # (box, local)


def is_model(obj: Any) -> bool:
    return owner_of(obj).role == "model"


def is_optimizer(obj: Any) -> bool:
    return layout.innermost_optimizer(obj) is not None


# -- what a rank holds ----------------------------------------------------------------------------


def model_pieces(name: str, model: Any) -> dict[str, Piece]:
    """Every one-process tensor of `model` under `<name>.`, with the boxes this rank holds (none
    for a tensor another rank holds: a pipeline's other stages are not listed at all)."""
    pieces: dict[str, Piece] = {}
    for held in layout.held(model):
        for placement in held.placements:
            key = f"{name}.{placement.name}"
            piece = pieces.setdefault(key, Piece(key, placement.shape))
            piece.chunks += [(chunk, held.tensor) for chunk in placement.chunks]
    return pieces


def optimizer_pieces(name: str, optimizer: Any, models: list[Any]
                     ) -> tuple[dict[str, Piece], dict[str, Any], dict[str, tuple]]:
    """(tensor state as pieces, everything else by key: non-tensor state and `<name>.param_groups`,
    whose parameters are one-process names; what the layout covers of each parameter, state or
    none, by `<name>.<parameter>`: a part lost with a rank is missing there even before the
    first step)."""
    inner, params = layout.optimizer_params(optimizer, models)
    pieces: dict[str, Piece] = {}
    values: dict[str, Any] = {}
    covered: dict[str, tuple] = {}
    names_of = {}
    for p, placements in params:
        names_of[id(p)] = [pl.name for pl in placements]
        for pl in placements:
            covered.setdefault(f"{name}.{pl.name}", (pl.shape, []))[1].extend(
                (c.offsets, c.sizes) for c in pl.chunks)
        for k, v in inner.state.get(p, {}).items():
            if per_element(k, v, p):
                for placement in placements:
                    key = f"{name}.state.{placement.name}.{k}"
                    piece = pieces.setdefault(key, Piece(key, placement.shape))
                    piece.chunks += [(chunk, v) for chunk in placement.chunks]
            elif isinstance(v, torch.Tensor):
                for placement in placements:  # a scalar (Adam's step), a factor: one per name
                    key = f"{name}.state.{placement.name}.{k}"
                    pieces[key] = Piece(key, tuple(v.shape), [(layout.whole(key, v).chunks[0], v)])
            elif v is not None:
                for placement in placements:
                    values[f"{name}.state.{placement.name}.{k}"] = v
    values[f"{name}.param_groups"] = [
        {**{k: v for k, v in g.items() if k != "params"},
         "params": [n for p in g["params"] for n in names_of[id(p)]]} for g in inner.param_groups]
    return pieces, values, covered


def _models(objects: dict[str, Any], models: list[Any] | None) -> list[Any]:
    return [obj for obj in objects.values() if is_model(obj)] if models is None else models


def pieces_of(objects: dict[str, Any], models: list[Any] | None = None
              ) -> tuple[dict[str, Piece], dict[str, Any], dict[str, tuple]]:
    """(tensor pieces, values, what the layouts cover) of the models and optimizers in
    `objects` (by name); an optimizer's state is named by the parameters of `models` (default:
    those among `objects`)."""
    models = _models(objects, models)
    pieces: dict[str, Piece] = {}
    values: dict[str, Any] = {}
    covered: dict[str, tuple] = {}
    for name, obj in objects.items():
        if is_model(obj):
            found = model_pieces(name, obj)
            pieces.update(found)
            covered.update({k: (p.shape, [(c.offsets, c.sizes) for c, _ in p.chunks])
                            for k, p in found.items()})
        elif is_optimizer(obj):
            tensors, more, over = optimizer_pieces(name, obj, models)
            pieces.update(tensors)
            values.update(more)
            covered.update(over)
    return pieces, values, covered


# -- what a rank needs in its new layout ------------------------------------------------------------


@dataclass
class OptimizerTargets:
    """Where an optimizer's state goes, in its current layout: tensors made for each state key
    the holders listed (per element: shaped as the parameter, filled box by box; otherwise
    whole), then loaded into the torch optimizer once filled (`load`)."""

    inner: torch.optim.Optimizer
    params: Params
    state: dict[int, dict[str, Any]]
    reads: dict[str, list[tuple[Chunk, torch.Tensor]]]
    values: list[tuple[int, str, str]]  # (parameter index, state key, key) of non-tensor state
    groups_key: str

    def load(self, values: dict[str, Any]) -> None:
        """Load the filled state, with the values (non-tensor state, param_groups) read.

        Raises:
            ValueError: the saved param groups are not as many as the optimizer's.
        """
        for i, k, key in self.values:
            self.state[i][k] = values[key]
        saved_groups = values[self.groups_key]
        if len(saved_groups) != len(self.inner.param_groups):
            raise ValueError(f"the optimizer has {len(self.inner.param_groups)} param groups, "
                             f"the saved state {len(saved_groups)}: build it as when it was saved")
        index, groups = 0, []
        for saved, group in zip(saved_groups, self.inner.param_groups, strict=True):
            n = len(group["params"])
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(index, index + n))})
            index += n
        for i, (p, _) in enumerate(self.params):
            for k, v in list(self.state.get(i, {}).items()):
                if isinstance(v, torch.Tensor):
                    self.state[i][k] = v.to(p.device) if v.dim() else v
        self.inner.load_state_dict({"state": self.state, "param_groups": groups})


def optimizer_targets(name: str, optimizer: Any, models: list[Any],
                      saved: dict[str, tuple[tuple[int, ...], torch.dtype] | None]) -> OptimizerTargets:
    """Where `optimizer`'s state goes, given what was saved (or is held): `saved` maps each key
    to its (shape, dtype), or None for a value.

    Raises:
        KeyError: nothing holds `<name>.param_groups`.
    """
    inner, params = layout.optimizer_params(optimizer, models)
    groups_key = f"{name}.param_groups"
    if groups_key not in saved:
        raise KeyError(f"the checkpoint has no {groups_key}")
    state: dict[int, dict[str, Any]] = {}
    reads: dict[str, list[tuple[Chunk, torch.Tensor]]] = {}
    values: list[tuple[int, str, str]] = []
    # '<name>.state.<parameter name>.<state key>', indexed once by parameter name (a scan of
    # every key per parameter would be quadratic in the model's size).
    by_parameter: dict[str, list[tuple[str, str, Any]]] = {}
    prefix = f"{name}.state."
    for key, what in saved.items():
        if key.startswith(prefix):
            parameter, _, k = key[len(prefix):].rpartition(".")
            by_parameter.setdefault(parameter, []).append((k, key, what))
    for i, (p, placements) in enumerate(params):
        for placement in placements:
            for k, key, what in by_parameter.get(placement.name, []):
                entry = state.setdefault(i, {})
                if what is None:
                    if k not in entry:
                        entry[k] = None
                        values.append((i, k, key))
                    continue
                shape, dtype = what
                if per_element_shapes(k, shape, placement.shape):
                    if k not in entry:
                        entry[k] = torch.zeros_like(p.detach())
                    reads.setdefault(key, []).extend((c, entry[k]) for c in placement.chunks)
                elif k not in entry:
                    entry[k] = torch.zeros(shape, dtype=dtype)
                    chunk = layout.whole(key, entry[k]).chunks[0]
                    reads.setdefault(key, []).append((chunk, entry[k]))
    return OptimizerTargets(inner, params, state, reads, values, groups_key)


class Targets:
    """What this rank needs of `objects` (models, optimizers) in their current layout, given
    `index` (what the holders hold, `merge`d): the boxes to read, and the values."""

    def __init__(self, objects: dict[str, Any], index: dict[str, Any],
                 models: list[Any] | None = None) -> None:
        models = _models(objects, models)
        self.reads: dict[str, list[tuple[Chunk, torch.Tensor]]] = {}
        self.optimizers: list[OptimizerTargets] = []
        saved = {**{k: None for k in index["values"]},
                 **{k: (shape, dtype) for k, (shape, dtype, _) in index["tensors"].items()}}
        for name, obj in objects.items():
            if is_model(obj):
                self.reads.update({k: p.chunks for k, p in model_pieces(name, obj).items()})
            elif is_optimizer(obj):
                self.optimizers.append(optimizer_targets(name, obj, models, saved))
        for targets in self.optimizers:
            self.reads.update(targets.reads)
        self.value_keys = sorted({key for t in self.optimizers for _, _, key in t.values}
                                 | {t.groups_key for t in self.optimizers})

    def wanted(self) -> dict[str, Any]:
        """The boxes and values to ask the holders for (a small, picklable description)."""
        return {"boxes": {key: [(c.offsets, c.sizes) for c, _ in chunks]
                          for key, chunks in self.reads.items() if chunks},
                "values": self.value_keys}

    def fill(self, received: Iterable[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]],
             values: dict[str, Any]) -> None:
        """Write each received box into the local tensors it intersects; load the optimizers."""
        with torch.no_grad():
            for key, offsets, sizes, data in received:
                for chunk, local in self.reads.get(key, ()):
                    common = overlap((offsets, sizes), (chunk.offsets, chunk.sizes))
                    if common is not None:
                        region(chunk.view(local), chunk.offsets, common).copy_(
                            region(data, offsets, common))
        for targets in self.optimizers:
            targets.load(values)


# -- held state as data (a commit in memory), and the boxes each rank needs of it --------------------


def take(objects: dict[str, Any], models: list[Any] | None = None) -> dict[str, Any]:
    """A copy of what this rank holds of `objects` (no communication): each box as a tensor of
    its own, the values, and what the layout covers."""
    pieces, values, covered = pieces_of(objects, models)
    tensors = {key: (piece.shape, piece.chunks[0][1].dtype,
                     [(c.offsets, c.sizes, c.view(local).detach().clone()) for c, local in piece.chunks])
               for key, piece in pieces.items() if piece.chunks}
    return {"tensors": tensors, "values": values, "covers": covered}


def fill_from(parts: list[dict[str, Any]], objects: dict[str, Any],
              models: list[Any] | None = None) -> None:
    """`objects`, in their current layout, filled from `parts` (`take`'s) held here alone."""
    targets = Targets(objects, merge([index(parts)])[0], models)
    targets.fill(*cut(parts, targets.wanted(), lambda key, box: True))


def index(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `parts` (`take`'s) hold, without the data."""
    return [{"tensors": {k: (shape, dtype, [(o, s) for o, s, _ in boxes])
                         for k, (shape, dtype, boxes) in part["tensors"].items()},
             "values": list(part["values"]), "covers": part["covers"]} for part in parts]


def merge(indexes: list[list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[tuple[str, Any], int]]:
    """(every rank's `index` as one, each box once; the rank that sends each box and value
    (box None): its lowest holder)."""
    tensors: dict[str, tuple[tuple[int, ...], Any, list[Box]]] = {}
    sender: dict[tuple[str, Any], int] = {}
    covered: dict[str, tuple[tuple[int, ...], list[Box]]] = {}
    for rank, found in ((r, part) for r, parts in enumerate(indexes) for part in parts):
        for key, (shape, dtype, boxes) in found["tensors"].items():
            listed = tensors.setdefault(key, (shape, dtype, []))[2]
            listed += [box for box in boxes if sender.setdefault((key, box), rank) == rank
                       and box not in listed]
        for key in found["values"]:
            sender.setdefault((key, None), rank)
        for label, (shape, boxes) in found["covers"].items():
            covered.setdefault(label, (shape, []))[1].extend(boxes)
    values = sorted(key for key, box in sender if box is None)
    return {"tensors": tensors, "values": values, "covers": covered}, sender


def holes(covered: dict[str, tuple[tuple[int, ...], list[Box]]]) -> dict[str, list[tuple[int, int]]]:
    """The elements [a, b) (row-major) of each one-process tensor that no box covers."""
    out = {}
    for label, (shape, boxes) in covered.items():
        unique = set(boxes)
        if sum(math.prod(s) for _, s in unique) >= math.prod(shape):
            continue  # the layouts' boxes never overlap: as many elements as the tensor is all
        mask = torch.zeros(shape, dtype=torch.bool)
        for offsets, sizes in unique:
            region(mask, (0,) * len(shape), (offsets, sizes)).fill_(True)
        flat = torch.cat([torch.tensor([True]), mask.reshape(-1), torch.tensor([True])])
        edges = (flat[1:].int() - flat[:-1].int()).nonzero().flatten().tolist()
        out[label] = list(zip(edges[0::2], edges[1::2], strict=True))
    return out


def cut(parts: list[dict[str, Any]], wanted: dict[str, Any], mine: Any
        ) -> tuple[list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]], dict[str, Any]]:
    """What one rank `wanted` (its `Targets.wanted()`) of `parts`: the intersections of each box
    held with each box wanted, and the values wanted; `mine(key, box)` says which boxes this
    rank sends (box None: a value)."""
    boxes: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
    values: dict[str, Any] = {}
    for part in parts:
        for key, (_, _, held) in part["tensors"].items():
            for offsets, sizes, data in held:
                if not mine(key, (offsets, sizes)):
                    continue
                for want in wanted["boxes"].get(key, ()):
                    common = overlap((offsets, sizes), want)
                    if common is not None:
                        boxes.append((key, *common, region(data, offsets, common)))
        for key, value in part["values"].items():
            if key in wanted["values"] and key not in values and mine(key, None):
                values[key] = value
    return boxes, values


def overlap(a: Box, b: Box) -> Box | None:
    """The box common to boxes `a` and `b` of one tensor (None: they do not meet)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def region(tensor: torch.Tensor, offsets: tuple[int, ...], box: Box) -> torch.Tensor:
    """The part of `tensor` (a box of a one-process tensor at `offsets`) that is `box` (a view)."""
    for dim, (at, start, n) in enumerate(zip(offsets, box[0], box[1], strict=True)):
        tensor = tensor.narrow(dim, start - at, n)
    return tensor
