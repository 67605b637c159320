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
- Checkpoints hold the unsharded model and optimizer state (`state_dict()` speaks the
  one-process model; `td.full_optimizer_state_dict`); resuming the optimizer state is refused.

Every rank must run the same forwards, validation included: each one gathers.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import tandem as td
from tandem.lightning.trainer import TandemStrategy


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
        inner = [m for m in model.modules() if m is not model and isinstance(m, self._shard)]
        for module in reversed(inner):  # the innermost first, as fully_shard asks
            td.fully_shard(module, **self._unit_options)
        td.fully_shard(model, **self._unit_options)
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

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if isinstance(self.model, _Root):
            return td.full_optimizer_state_dict(self.lightning_module, optimizer)
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        raise NotImplementedError(
            "strategy 'tandem_fsdp' saves the unsharded optimizer state but cannot resume it yet; "
            "resume with strategy='tandem' (same checkpoint format), or load only the weights: "
            "Trainer.fit(model, ckpt_path=None) after model.load_state_dict(ckpt['state_dict'])")

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
