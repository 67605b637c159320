"""FSDP2's DTensor parameters on a `td.fully_shard` unit: what `tandem.fsdp.fully_shard` adds.

torch code written for FSDP2 asks its parameters and their optimizer state DTensor questions:
the FSDP2 example's checkpointer calls `param.full_tensor()`, `distribute_tensor(full,
param.device_mesh, param.placements)`, and saves an optimizer moment as a whole tensor only
`if isinstance(moment, DTensor)` (a plain tensor is taken as it is: a shard would be saved as
if it were the whole, silently). So a unit made by `tandem.fsdp.fully_shard` (`dtensor=True`)
keeps its flat fp32 shard as a real `torch.distributed.tensor.DTensor` parameter:

- `model.parameters()`: one DTensor per unit, `placements == (Shard(0),)` over a 1-D
  `DeviceMesh` of the world (tandem's engine backs torch's group, Gloo and MPI alike); its
  global tensor is the unit's padded flat space (N * shard_numel elements), its local tensor
  the shard tandem gathers and reduces into (same storage). Optimizers build DTensor state
  from it, `torch.nn.utils.clip_grad_norm_` reduces its DTensor gradient's norms over the mesh;
- `model.state_dict()`: the one-process names, each a DTensor `Replicate()` holding the whole
  tensor (gathered, as for `td.fully_shard`): `full_tensor()` is that tensor, and
  `distribute_tensor(full, entry.device_mesh, entry.placements)` gives every rank rank 0's;
- `model.load_state_dict(...)` takes those entries (DTensors of any layout, or plain whole
  tensors), also with `assign=True` and into a model still on the meta device (the shard is
  then made on the values' device); `model.to_empty(device=...)` keeps the unit's shard.

The hot paths use the local tensor: no DTensor dispatch in a gather or a reduce-scatter.
A unit over a subgroup, a mesh (HSDP) or with CPU offload is refused here with the fix
(`td.fully_shard`, whose shards are plain tensors), and so are tandem's own checkpoints and
layout walkers (`td.checkpoint.save_sharded`, `td.Checkpointer`, `td.get_state_dict`: `pieces.py`) and a
change of world (`resize.py`): such a model saves as under FSDP2 (DCP, or the DTensor API).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.parallel.fully_shard.unit import SHARD, Unit, unit_of

_MESHES: dict[str, tuple[Any, Any]] = {}  # device type -> (torch's world group, its 1-D mesh)


def refuse_unless_world(group: Any, mesh: Any, offload: Any, offload_policy: Any) -> None:
    """DTensor parameters cover a unit over the whole world, not offloaded: the rest is refused."""
    said = [what for what, given in (("group=", group), ("mesh=", mesh), ("offload=", offload),
                                     ("offload_policy=", offload_policy)) if given is not None]
    if said:
        raise ValueError(
            f"tandem.fsdp.fully_shard (FSDP2's DTensor parameters) shards over the whole world "
            f"and keeps the shards where the module is; it was given {', '.join(said)}. Use "
            f"td.fully_shard(module, {said[0]}...) for that: the same sharding with plain tensor "
            f"shards (td.fsdp.full_state_dict / td.clip_grad_norm_ instead of DTensor calls)")


def join_torch_group() -> None:
    """A port that made torch's process group (`init_process_group`) and never called
    `td.init()`: tandem joins that group, as `td.init()` would."""
    import torch.distributed as dist

    if not runtime.is_initialized() and dist.is_available() and dist.is_initialized():
        runtime.init()


def world_mesh(device: torch.device) -> Any:
    """The 1-D DeviceMesh over torch's world group (made once per device type)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError(
            f"tandem.fsdp.fully_shard on rank {runtime.rank()}: torch.distributed has no process "
            f"group, so its DTensor parameters have no DeviceMesh. Call td.init() (or "
            f"torch.distributed.init_process_group()) before fully_shard")
    kind = device.type if device.type != "meta" else runtime.device().type
    world = dist.group.WORLD
    if kind not in _MESHES or _MESHES[kind][0] is not world:  # (a new group after a restart)
        _MESHES[kind] = (world, DeviceMesh.from_group(world, kind))
    return _MESHES[kind][1]


def enable(module: nn.Module, unit: Unit, pieces: Any) -> None:
    """Make `unit`'s shard a DTensor parameter and give `module` the hooks that keep it one
    and that make its state dict speak the one-process model (`pieces`: the unit's
    `UnitPieces`, whose `full_tensors` gathers the whole tensors)."""
    unit.shard_replaced = False
    if unit.shard is not None:  # (else a root that only holds units)
        unit.mesh = world_mesh(unit.local_shard().device)
        unit.set_shard(unit.shard.detach())
        unit.is_root = unit.is_root  # its agreement counts the steps of the new parameter
    module.register_state_dict_post_hook(
        lambda module, state, prefix, metadata: _to_full(unit, pieces, state, prefix))
    module.register_load_state_dict_pre_hook(
        lambda module, state, prefix, *rest: _to_local(unit, state, prefix))
    module.register_load_state_dict_post_hook(lambda module, keys: _after(module))
    apply = module._apply

    def _apply(fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        """`model.to_empty(device=...)`, `.to(...)`: torch applies `fn` to the plain local
        shard (it cannot swap a DTensor parameter's contents), which then becomes the unit's
        DTensor parameter again; the same parameter when nothing changed. A shard that was on
        the meta device has memory after `to_empty` but no values (FSDP2's
        `reset_parameters()` would reach only tandem's placeholders): the next forward still
        says to run `materialize`."""
        shard = unit.shard
        if shard is None:
            return apply(fn, *args, **kwargs)
        local, was_meta = unit.local_shard(), unit.on_meta
        plain = nn.Parameter(local, requires_grad=shard.requires_grad)
        module._parameters[SHARD] = plain
        try:
            return apply(fn, *args, **kwargs)
        finally:
            new = module._parameters.get(SHARD)
            if new is plain and plain.device == local.device and plain.dtype == local.dtype \
                    and plain.data_ptr() == local.data_ptr():
                module._parameters[SHARD] = shard  # unchanged: the optimizer's parameter stays
            elif new is not None:
                unit.mesh = world_mesh(new.device)
                unit.set_shard(new.detach())
                unit.on_meta = was_meta or new.device.type == "meta"
                unit.shard_replaced = True
            _refresh_root(module)  # (the root's hook runs last: its units' flags are set)

    object.__setattr__(module, "_apply", _apply)


def _after(module: nn.Module) -> None:
    adopt(module)
    _refresh_root(module)


def adopt(module: nn.Module) -> None:
    """The module's registered shard, if torch replaced it (`load_state_dict(assign=True)`,
    `to_empty`), becomes the unit's again: a DTensor over the unit's mesh."""
    unit = unit_of(module)
    new = module._parameters.get(SHARD)
    if unit is None or new is None or new is unit.shard:
        return
    local = new._local_tensor if hasattr(new, "_local_tensor") else new
    unit.set_shard(local.detach())
    unit.on_meta = local.device.type == "meta"
    unit._placeholders()
    unit.shard_replaced = True


def _refresh_root(module: nn.Module) -> None:
    """A root whose units got new shard parameters: its agreement, which counts the optimizer
    steps over them, is made again (children's hooks run first, the root's last)."""
    root = unit_of(module)
    if root is None or not root.is_root:
        return
    found = [u for m in module.modules() if (u := unit_of(m)) is not None]
    if any(getattr(u, "shard_replaced", False) for u in found):
        for u in found:
            u.shard_replaced = False
        root.is_root = True


def _to_full(unit: Unit, pieces: Any, state: dict, prefix: str) -> None:
    """After `state_dict()`: the unit's flat entry becomes the one-process entries, each the
    whole tensor (gathered over the world: every rank calls it) as a DTensor Replicate()."""
    from torch.distributed.tensor import DTensor, Replicate

    if unit.shard is None:
        return
    state.pop(prefix + SHARD, None)
    for name, tensor in pieces.full_tensors(prefix).items():
        state[name] = DTensor.from_local(tensor, unit.mesh, (Replicate(),), run_check=False)


def _to_local(unit: Unit, state: dict, prefix: str) -> None:
    """Before `load_state_dict`: the one-process entries (DTensors or plain) become this rank's
    shard under the unit's own key, a DTensor of the parameter's layout. A unit still on the
    meta device gets its shard made on the values' device first."""
    from torch.distributed.tensor import DTensor

    if unit.shard is None:
        return
    names = [prefix + n for n in unit.names]
    if not all(name in state for name in names):
        return  # the local entry itself, or a partial dict: torch's own checks report it
    if any(tuple(state[n].shape) != tuple(s) for n, s in zip(names, unit.shapes, strict=True)):
        return  # torch's size-mismatch error names it
    with torch.no_grad():
        values = [state[n].full_tensor() if isinstance(state[n], DTensor) else state[n]
                  for n in names]
        values = [v.as_subclass(torch.Tensor) if isinstance(v, nn.Parameter) else v
                  for v in values]
        current = unit.local_shard()
        device = current.device if current.device.type != "meta" else values[0].device
        local = torch.zeros(unit.shard_numel, dtype=current.dtype, device=device)
        lo, hi = unit.rank * unit.shard_numel, (unit.rank + 1) * unit.shard_numel
        offset = 0
        for value, shape in zip(values, unit.shapes, strict=True):
            n = torch.Size(shape).numel()
            a, b = max(offset, lo), min(offset + n, hi)
            if a < b:
                local[a - lo: b - lo].copy_(value.reshape(-1)[a - offset: b - offset])
            offset += n
    for name in names:
        state.pop(name)
    if current.device.type == "meta":  # the model on the meta device: the shard is made here
        unit.set_shard(local.clone())
        unit.on_meta = False
        unit._placeholders()
        unit.shard_replaced = True
    state[prefix + SHARD] = unit.as_dtensor(local)
