"""`td.fsdp.FSDPModule`: the `isinstance` check of a ported FSDP2 script.

    from torch.distributed.fsdp import FSDPModule     # FSDP2
    from tandem.fsdp import FSDPModule                # the one line a td.fully_shard port changes

    assert isinstance(model, FSDPModule)              # True after td.fully_shard(model)

Why not torch's own class: `td.fully_shard` keeps the module's class (it binds FSDP2's methods
on the instance, `fsdp2_methods.py`), and making the module a subclass of torch's
`FSDPModule` would hand it to torch code that branches on that class: DCP's
`get_/set_model_state_dict` and torch's state-dict and clipping helpers would then take the
flat fp32 shards for FSDP2's DTensor parameters and ask torch's FSDP state, which a tandem unit
does not have. So `isinstance(model, torch.distributed.fsdp.FSDPModule)` stays False, and
tandem's class answers True for exactly the modules `td.fully_shard` was applied to.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem.parallel.fully_shard.unit import unit_of


class _FullyShardedCheck(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, nn.Module) and unit_of(instance) is not None


class FSDPModule(metaclass=_FullyShardedCheck):
    """`isinstance(module, td.fsdp.FSDPModule)`: whether `td.fully_shard` was applied to it
    (FSDP2's check, for a port; never instantiated: `td.fully_shard` keeps the module's class).

    Raises:
        TypeError: when instantiated.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDPModule:
        raise TypeError("td.fsdp.FSDPModule is for isinstance checks; td.fully_shard(module) "
                        "makes a module one")
