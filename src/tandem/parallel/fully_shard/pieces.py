"""A fully sharded unit's side of the layout protocol (`parallel/layout/pieces.py`)."""

from __future__ import annotations

import torch

from tandem.comm.collectives import user as collectives
from tandem.parallel.fully_shard.unit import Unit
from tandem.parallel.layout.pieces import Held


class UnitPieces:
    """A unit's side of the layout protocol (`parallel/layout/pieces.py`): its shard holds a range of
    the flat space in which its parameters lie end to end."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def local_pieces(self, prefix: str) -> list[Held]:
        unit = self.unit
        return [Held(unit.shard, unit.space.placements([prefix + n for n in unit.names], unit.shapes))]

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        unit = self.unit
        shard = unit.shard.detach()
        flat = collectives.allgather(shard, group=unit.group) if unit.size > 1 else shard
        out, offset = {}, 0
        for name, shape in zip(unit.names, unit.shapes, strict=True):
            n = torch.Size(shape).numel()
            out[prefix + name] = flat[offset : offset + n].view(shape).clone()
            offset += n
        return out
