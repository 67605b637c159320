"""`Fabric(strategy="tandem_fsdp")`: the model fully sharded with `td.fully_shard`.

The Fabric twin of `sharded.TandemFSDPStrategy`: `fabric.setup_module(model)` makes every
`nn.Linear`/`nn.Conv2d` a unit and the model the root; the optimizer is then made over the
shards (`fabric.setup_optimizers(...)`), since `model.parameters()` changed. `fabric.clip_gradients`
clips by the global norm, `fabric.no_backward_sync` is `td.no_sync`, and `fabric.save`/`fabric.load`
write and read a directory: `shards/` (the modules and optimizers of the state, each rank its
pieces, `td.checkpoint.save_sharded`) and `rest.pt` (everything else, `td.save`).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer

import tandem as td
from tandem.lightning import common
from tandem.lightning.fabric import TandemFabricStrategy

SHARDS, REST = "shards", "rest.pt"


class TandemFabricFSDPStrategy(TandemFabricStrategy):
    """Fully sharded data parallelism for Lightning Fabric over tandem.

    Args:
        shard: module classes that become units of their own. Default: `nn.Linear`, `nn.Conv2d`.
        param_dtype, reshard_after_forward: passed to `td.fully_shard`.
    """

    def __init__(self, *args: Any, shard: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d),
                 param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shard = tuple(shard)
        self._unit_options = {"param_dtype": param_dtype,
                              "reshard_after_forward": reshard_after_forward}
        self._backward_sync_control = _ShardedNoSync()

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None):
        raise ValueError(
            "strategy 'tandem_fsdp' replaces the model's parameters by this rank's shards, so an "
            "optimizer made before would step parameters that no longer train. Set up the model "
            "first: model = fabric.setup_module(model); optimizer = "
            "fabric.setup_optimizers(torch.optim.SGD(model.parameters(), ...))")

    def setup_module(self, module: nn.Module) -> nn.Module:
        return common.shard_model(module, self._shard, self._unit_options)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        # the global norm, over every rank's shards (torch's would see this rank's alone)
        return td.clip_grad_norm_(module, max_norm, norm_type=norm_type)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return module.state_dict()  # the unsharded model's (a collective)

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        if filter or not common.own_checkpoints(self._checkpoint_io):
            return super().save_checkpoint(path, state, storage_options, filter)
        path = Path(os.fspath(path))
        objects, rest = _split(state)
        if td.rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        td.checkpoint.save_sharded(path / SHARDS, **objects)
        td.save(rest, path / REST)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None):
        path = Path(os.fspath(path))
        sharded = td.broadcast_object((path / SHARDS).is_dir() if td.rank() == 0 else None)
        if not sharded or not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        objects, _ = _split(state)
        td.checkpoint.load_sharded(path / SHARDS, **objects)  # in place, whatever the layout now
        rest = td.load(path / REST, weights_only=bool(weights_only))
        for name in list(rest):
            if name in state and name not in objects:
                state[name] = rest.pop(name)
        return rest

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "tandem_fsdp" not in strategy_registry:
            strategy_registry.register(
                "tandem_fsdp", cls,
                description="Fully sharded data parallelism over tandem's engine (td.fully_shard)")


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The modules and optimizers of a Fabric state (to shard), and the rest."""
    objects = {k: v for k, v in state.items() if isinstance(v, (nn.Module, Optimizer))}
    return objects, {k: v for k, v in state.items() if k not in objects}


class _ShardedNoSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the units keep their gradients until the next sync."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return td.no_sync(module) if enabled else nullcontext()
