"""`td.fsdp`: fully sharded data parallelism (ZeRO-3, FSDP2's spellings), the front door (the code
lives in `tandem.parallel.fully_shard`).

    for block in model.blocks:
        td.fully_shard(block, mp_policy=td.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    td.fully_shard(model)
    td.fsdp.set_requires_gradient_sync(model, False)    # accumulate over micro-batches

`fully_shard` here is FSDP2's, for a port of an FSDP2 script: `td.fully_shard(...,
dtensor=True)`, whose parameters, optimizer state and state-dict entries are DTensors
(`full_tensor()`, `device_mesh`, `placements`), so the script's checkpointing and
`torch.nn.utils.clip_grad_norm_` run as under FSDP2. `td.fully_shard` keeps plain tensor
shards (and takes subgroups, HSDP meshes and offload). Its policies, `materialize` for a
model built on the meta device, and the unsharded state: `full_state_dict`,
`full_optimizer_state_dict`, `load_full_state_dict` (`td.get_state_dict` /
`td.set_state_dict` do the same for any split).
`FSDPModule` answers `isinstance(model, FSDPModule)` for a fully sharded module (FSDP2's check).
"""

from tandem.parallel.fully_shard import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_state_dict,
    materialize,
)
from tandem.parallel.fully_shard.fsdp2 import fully_shard
from tandem.parallel.gradient_sync import set_requires_gradient_sync

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_",
           "full_optimizer_state_dict", "full_state_dict", "fully_shard", "load_full_state_dict",
           "materialize",
           "set_requires_gradient_sync"]
