"""`Trainer(strategy="tandem")`: Lightning's Trainer on tandem's engine.

Written after Lightning's `DDPStrategy`, with tandem in each place where it talks to other
ranks: `td.init()` joins the job the launcher started (no Lightning launcher, no
`init_process_group` of Lightning's), the model is wrapped by `td.DistributedDataParallel`
(gradients averaged during backward, so precision plugins, gradient clipping and
`accumulate_grad_batches` work as on one process), `reduce`/`all_gather`/`broadcast`/`barrier`
(and so `self.log(..., sync_dist=True)`) are tandem's checked and watched collectives, and
checkpoints are `td.save`/`td.load` (rank 0 writes atomically, every rank learns the outcome).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn

import tandem as td
from tandem.lightning import common, names
from tandem.lightning.environment import TandemEnvironment


class TandemStrategy(ParallelStrategy):
    """Data parallelism for Lightning's Trainer over tandem (Gloo, NCCL or MPI).

    Args:
        cluster_environment: defaults to `TandemEnvironment()`, the job as tandem's launchers
            describe it.
        **ddp_kwargs: passed to `td.DistributedDataParallel` (`compression`, `bucket_mb`, ...).
    """

    strategy_name = "tandem"

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, **ddp_kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment or TandemEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._ddp_kwargs = ddp_kwargs
        self._num_nodes = 1
        self._joined = None  # tandem's runtime state once setup_environment joined the job

    # --- the job -----------------------------------------------------------------------------

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

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector for strategies it does not know: True makes the Trainer
        # give each rank its shard of the data (DistributedSampler), as DDP does.
        return True

    def _configure_launcher(self) -> None:
        self._launcher = None  # tandem run / mpiexec / srun started every process already

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = self.global_rank  # progress bars, loggers: rank 0 alone

    def setup_environment(self) -> None:
        accelerator = "cpu" if self.root_device.type == "cpu" else "cuda"
        common.check_layout(self.parallel_devices, self.num_nodes, self.cluster_environment,
                            accelerator)
        super().setup_environment()
        self._joined = common.join(self.cluster_environment)

    # --- the model -----------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        # configure_model() ran between setup_environment() and here: it must have left the
        # world alone.
        common.check_same_world(self._joined, "configure_model()")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.model = self._setup_model(self.model)
            self.setup_optimizers(trainer)
        elif td.size() > 1:
            # Evaluation only: no wrapper, but every rank starts from rank 0's weights.
            td.broadcast_parameters(self.model)
            td.broadcast_buffers(self.model)
        self.setup_precision_plugin()

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return td.DistributedDataParallel(model, **self._ddp_kwargs)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """accumulate_grad_batches: passes inside only accumulate; the last one reduces all."""
        if isinstance(self.model, td.DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    # --- collectives ---------------------------------------------------------------------------

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        # self.log(..., sync_dist=True) reduces here: agree on the logged name too (`names`)
        name = names.logged()
        if name is None:
            return common.all_reduce(tensor, group, reduce_op)
        return names.all_reduce(tensor, group, reduce_op, name)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None,
                   sync_grads: bool = False) -> torch.Tensor:
        return common.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj, src: int = 0):
        return common.broadcast(obj, src)

    def barrier(self, name: str | None = None) -> None:
        common.barrier()

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        if not common.own_checkpoints(self._checkpoint_io):  # the user's CheckpointIO decides
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        common.save(checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if not common.own_checkpoints(self._checkpoint_io):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # rank 0 reads, every rank gets the same object. Lightning's own checkpoints hold
        # hyper-parameters and loop state: weights_only=None means the checkpoint is trusted.
        return td.load(checkpoint_path, weights_only=bool(weights_only))

    def teardown(self) -> None:
        if isinstance(self.model, td.DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as DDPStrategy does
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "tandem" not in strategy_registry:
            strategy_registry.register(
                "tandem", cls, description="Data parallelism over tandem's engine (Gloo, NCCL, MPI)")
