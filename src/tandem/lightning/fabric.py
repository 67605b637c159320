"""`Fabric(strategy="tandem")`: Lightning Fabric on tandem's engine.

The Fabric twin of `trainer.TandemStrategy`: `fabric.launch()` joins the job the launcher
started (`td.init()`), `fabric.setup(model, optimizer)` wraps the model in
`td.DistributedDataParallel`, `fabric.no_backward_sync(model)` is its `no_sync()`, and
`all_reduce`/`all_gather`/`broadcast`/`barrier` and `fabric.save`/`fabric.load` go through
tandem (rank 0 writes the checkpoint; every rank reads rank 0's copy).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

import tandem as td
from tandem.lightning import common
from tandem.lightning.environment import TandemEnvironment


class TandemFabricStrategy(ParallelStrategy):
    """Data parallelism for Lightning Fabric over tandem (Gloo, NCCL or MPI).

    Args:
        cluster_environment: defaults to `TandemEnvironment()`.
        **ddp_kwargs: passed to `td.DistributedDataParallel` (`compression`, `bucket_mb`, ...).
    """

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision=None, **ddp_kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment or TandemEnvironment(),
                         checkpoint_io=checkpoint_io, precision=precision)
        self._ddp_kwargs = ddp_kwargs
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    @property
    def root_device(self) -> torch.device:
        return common.root_device(self.parallel_devices, self.cluster_environment)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = None  # the processes exist already

    def _set_world_ranks(self) -> None:
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        accelerator = "cpu" if self.root_device.type == "cpu" else "cuda"
        common.check_layout(self.parallel_devices, self.num_nodes, self.cluster_environment,
                            accelerator)
        super().setup_environment()
        common.join(self.cluster_environment)
        self._set_world_ranks()

    def setup_module(self, module: nn.Module) -> nn.Module:
        return td.DistributedDataParallel(module, **self._ddp_kwargs)

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def all_reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        return common.all_reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None,
                   sync_grads: bool = False) -> torch.Tensor:
        return common.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj, src: int = 0):
        return common.broadcast(obj, src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        common.barrier()

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if isinstance(module, td.DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any],
                               strict: bool = True) -> None:
        if isinstance(module, td.DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict=strict)

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        if not common.own_checkpoints(self._checkpoint_io):
            return super().save_checkpoint(path, state, storage_options, filter)
        state = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        common.save(state, path)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "tandem" not in strategy_registry:
            strategy_registry.register(
                "tandem", cls, description="Data parallelism over tandem's engine (Gloo, NCCL, MPI)")


class _NoSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: tandem's `no_sync()` (the reducer skips the passes)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, td.DistributedDataParallel):
            raise TypeError("no_backward_sync needs the module that fabric.setup() returned "
                            f"(wrapped in td.DistributedDataParallel); got {type(module).__name__}")
        return module.no_sync()
