"""`tandem.fsdp.fully_shard`: FSDP2's `fully_shard`, as a port imports it.

    from torch.distributed.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy   # FSDP2
    from tandem.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy              # the port

The same sharding as `td.fully_shard` (one flat unit per call, gathered just in time), with
FSDP2's DTensor parameters (`dtensor.py`): torch code that asks `full_tensor()`,
`device_mesh`, `placements` or `isinstance(x, DTensor)` of the parameters, their optimizer
state or the state dict gets FSDP2's answers, and torch's own `clip_grad_norm_` and DCP's
`get_/set_model_state_dict`, `get_/set_optimizer_state_dict` work on them. A script that made
torch's process group (`init_process_group`) and not `td.init()` has tandem join that group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem.parallel.fully_shard import api, dtensor


def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | None = True,
                mp_policy: Any = None, offload_policy: Any = None) -> nn.Module:
    """FSDP2's `fully_shard(module)` on tandem: `td.fully_shard(module, dtensor=True)`.

    Collective, as `td.fully_shard`: every rank calls it, inner blocks first, then the root.

    Args:
        module: the module to shard.
        mesh: None, or FSDP2's 1-D `DeviceMesh` over the whole world (the same sharding); a
            mesh of another shape is refused (use `td.fully_shard(module, mesh=td.mesh(...))`).
        reshard_after_forward: free the gathered parameters after forward (FSDP2's default;
            None, newer FSDP2's default, is True here).
        mp_policy: a `MixedPrecisionPolicy` (tandem's or torch's).
        offload_policy: None or FSDP2's `OffloadPolicy()` (no offload); a CPU offload is
            refused here (use `td.fully_shard(..., offload_policy=...)`).

    Returns:
        `module`, fully sharded: its parameters are DTensors (`Shard(0)`), its state dict's
        entries DTensors (`Replicate()`, the whole tensors).

    Raises:
        ValueError: a mesh that is not 1-D over the whole world, an offload policy, or any of
            `td.fully_shard`'s refusals; each message says the fix.
        RuntimeError: torch.distributed has no process group (call `td.init()` first).
    """
    dtensor.join_torch_group()
    if mesh is not None:
        import torch.distributed as dist

        if getattr(mesh, "ndim", None) != 1 or mesh.size() != dist.get_world_size():
            raise ValueError(
                f"tandem.fsdp.fully_shard: mesh={mesh!r} is not a 1-D mesh over the whole "
                f"world ({dist.get_world_size()} ranks); for HSDP use td.fully_shard(module, "
                f"mesh=td.mesh(dp=replicas, shard=ranks per replica))")
    if type(offload_policy).__name__ == "OffloadPolicy":  # FSDP2's default: no offload
        offload_policy = None
    return api.fully_shard(module, reshard_after_forward=reshard_after_forward is not False,
                           mp_policy=mp_policy, offload_policy=offload_policy, dtensor=True)
