"""Fully sharded data parallelism (ZeRO-3, FSDP2-style); see `api` for the user guide."""

from tandem.parallel.fully_shard.api import (
    clip_grad_norm_,
    full_optimizer_state_dict,
    full_state_dict,
    fully_shard,
    load_full_state_dict,
    units,
)
from tandem.parallel.fully_shard.fsdp_module import FSDPModule
from tandem.parallel.fully_shard.materialize import materialize
from tandem.parallel.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_",
           "full_optimizer_state_dict", "full_state_dict", "fully_shard", "load_full_state_dict",
           "materialize", "units"]
