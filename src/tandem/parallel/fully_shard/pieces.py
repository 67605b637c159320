"""A fully sharded unit's side of the layout protocol (`parallel/layout/pieces.py`)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.comm.collectives import user as collectives
from tandem.parallel.fully_shard.unit import SHARD, Unit, unit_of
from tandem.parallel.layout import splits
from tandem.parallel.layout.owner import ModuleSplit, register_module_split
from tandem.parallel.layout.pieces import Held


class UnitPieces:
    """A unit's side of the layout protocol (`parallel/layout/pieces.py`): its shard holds a range of
    the flat space in which its parameters lie end to end."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def local_pieces(self, prefix: str) -> list[Held]:
        unit = self.unit
        if unit.mesh is not None:
            raise ValueError(
                f"{type(unit.module).__name__} was sharded by tandem.fsdp.fully_shard, whose "
                f"shards are DTensor parameters (FSDP2's): tandem's own checkpoints and layout "
                f"walkers (td.checkpoint.save_sharded, td.Checkpointer, td.get_state_dict) take "
                f"td.fully_shard's plain shards. Save this model as under FSDP2 (DCP's "
                f"get_model_state_dict/set_model_state_dict, or model.state_dict()'s DTensors "
                f"and full_tensor()), or shard it with td.fully_shard")
        return [Held(unit.shard, unit.space.placements([prefix + n for n in unit.names], unit.shapes))]

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        unit = self.unit
        shard = unit.local_shard().detach()
        if shard.device.type == "meta":  # shapes only (a model not yet materialised or loaded)
            flat = torch.empty(unit.size * unit.shard_numel, dtype=shard.dtype, device="meta")
        else:
            flat = collectives.allgather(shard, group=unit.group) if unit.size > 1 else shard
        out, offset = {}, 0
        for name, shape in zip(unit.names, unit.shapes, strict=True):
            n = torch.Size(shape).numel()
            out[prefix + name] = flat[offset : offset + n].view(shape).clone()
            offset += n
        return out


def _pieces_of(module: nn.Module) -> UnitPieces | None:
    unit = unit_of(module)
    return UnitPieces(unit) if unit is not None and unit.shard is not None else None


def _set_sync(module: nn.Module, on: bool) -> bool:
    unit = unit_of(module)
    if unit is None:
        return False
    unit.requires_gradient_sync = on
    return True


# Every model's owner (`parallel/layout/owner.py`) walks fully_shard's units through this.
register_module_split(ModuleSplit(
    splits.FULLY_SHARD, find=_pieces_of, marks=lambda module: unit_of(module) is not None,
    set_sync=_set_sync, hidden=frozenset({SHARD})))
