"""`Trainer(strategy="tandem_fsdp")`: the LightningModule fully sharded with `td.fully_shard`.

Each rank keeps 1/N of the parameters, gradients and optimizer state. The modules of the
classes in `shard` (every `nn.Linear` and `nn.Conv2d` by default) become units of their own,
gathered just in time, and the LightningModule the root unit around them. Everything else is
`TandemStrategy`'s, with the few places where a sharded model differs from a replicated one:

- Lightning calls `training_step` on the LightningModule itself when the strategy's model is
  that module, so the root unit's forward hooks would never run; the model is therefore held in
  a thin wrapper whose forward Lightning redirects to the step (as it does for DDP).
- `gradient_clip_val` clips by the global norm (`td.clip_grad_norm_`): torch's
  `clip_grad_norm_`, which Lightning's precision plugins call, sees this rank's shards only.
- `accumulate_grad_batches` turns the units' gradient sync off (`td.no_sync`).
- A checkpoint is a directory: `shards/`, the model and optimizers as each rank holds them
  (`td.checkpoint.save_sharded`, torch's DCP format, loadable on any world size and layout), and
  `trainer.pt`, the rest of Lightning's checkpoint (`td.save`). Nothing is gathered to save.
  Restoring (`fit(ckpt_path=...)`) loads the shards in place after set-up, when the sharded
  model and its optimizers exist; an unsharded checkpoint (strategy "tandem") loads too.

Every rank must run the same forwards, validation included: each one gathers.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tandem as td
from tandem.lightning import common
from tandem.lightning.trainer import TandemStrategy

SHARDS, REST = "shards", "trainer.pt"  # a checkpoint directory's two parts
# Lightning refuses to resume from a checkpoint without "optimizer_states"; this one's are in
# the shards, and the key says so.
IN_SHARDS = "in shards/ (strategy 'tandem_fsdp')"


class _Root(nn.Module):
    """Holds the sharded LightningModule so that Lightning calls it through `__call__`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class TandemFSDPStrategy(TandemStrategy):
    """Fully sharded data parallelism for Lightning's Trainer over tandem.

    Args:
        shard: module classes that become units of their own (inner units first, then the
            LightningModule as the root). Default: `nn.Linear` and `nn.Conv2d`.
        param_dtype, reshard_after_forward: passed to `td.fully_shard`.
    """

    def __init__(self, *args: Any, shard: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d),
                 param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shard = tuple(shard)
        self._unit_options = {"param_dtype": param_dtype,
                              "reshard_after_forward": reshard_after_forward}

    def _setup_model(self, model: nn.Module) -> nn.Module:
        common.shard_model(model, self._shard, self._unit_options)
        self.precision_plugin.clip_grad_by_norm = self._clip_by_global_norm
        return _Root(model)

    def _clip_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        td.clip_grad_norm_(self.lightning_module, clip_val)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, _Root):
            with td.no_sync(self.lightning_module):
                yield
        else:
            yield

    # --- checkpoints: a directory of shards plus the rest ------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the sharded model and optimizers: they must exist

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # save_checkpoint writes each rank's pieces; nothing is gathered

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def _objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {"model": self.lightning_module}
        for i, optimizer in enumerate(self.optimizers):
            objects[f"optimizer{i}"] = getattr(optimizer, "_optimizer", optimizer)
        return objects

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        if not common.own_checkpoints(self._checkpoint_io):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(os.fspath(filepath))
        if td.rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        td.checkpoint.save_sharded(path / SHARDS, **self._objects())
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        rest["optimizer_states"] = [IN_SHARDS] * len(self.optimizers)
        td.save(rest, path / REST)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(os.fspath(checkpoint_path))
        sharded = td.broadcast_object((path / SHARDS).is_dir() if td.rank() == 0 else None)
        if not sharded or not common.own_checkpoints(self._checkpoint_io):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        td.checkpoint.load_sharded(path / SHARDS, **self._objects())  # in place: model and optimizers
        return td.load(path / REST, weights_only=bool(weights_only))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # an unsharded checkpoint; the shards loaded already
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if all(state == IN_SHARDS for state in checkpoint["optimizer_states"]):
            return  # loaded with the shards
        raise NotImplementedError(
            "strategy 'tandem_fsdp' cannot load the unsharded optimizer state of a checkpoint "
            "written by strategy 'tandem'; resume it with strategy='tandem', or load the weights "
            "alone (model.load_state_dict(torch.load(path)['state_dict'])) and fit without "
            "ckpt_path")

    def teardown(self) -> None:
        if isinstance(self.model, _Root):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "tandem_fsdp" not in strategy_registry:
            strategy_registry.register(
                "tandem_fsdp", cls,
                description="Fully sharded data parallelism over tandem's engine (td.fully_shard)")
