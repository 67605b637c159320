"""Local SGD: replicas step on their own and average their parameters every `period` steps.

    opt = td.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), period=8)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.average()            # before evaluating or saving, when steps % period != 0

Wrap a plain torch optimizer (not a `DistributedOptimizer`: gradients stay local). Each step
is the inner optimizer's step on the local gradient; every `period`-th step then replaces each
parameter by its mean over the ranks, in a few flat all-reduces. Communication drops by a
factor of `period` against synchronous data parallelism. With `period=1` and plain SGD this is
exactly synchronous gradient averaging (the mean of `p - lr * g_r` is `p - lr * mean(g_r)`).

The optimizer's own state (momentum, Adam's moments) stays local, as in "post-local SGD"; only
parameters are averaged, not buffers (BatchNorm statistics): broadcast those with
`td.broadcast_parameters` or average them yourself when they matter.

Uneven batches cannot be weighted here (there is no averaged gradient to weight: each rank
steps on its own mean), so a step whose batch `td.partition_dataset(pad=False)` or
`td.samples(n)` reported as uneven is refused, naming the fix, instead of averaging each rank
1/k (a silently different result from one process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tandem import runtime
from tandem.comm.agreement.agree import agree_layout, describe_tensors
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.collectives.tensors import coalesced
from tandem.comm.groups import Group, group_size
from tandem.diagnostics import steps
from tandem.parallel.data_parallel.samples import RoundSamples
from tandem.parallel.layout import splits
from tandem.parallel.layout.owner import WrapperOwner, owner_of, register


class LocalSGD:
    """Wrap a torch optimizer so that replicas synchronise parameters every `period` steps.

    Args:
        optimizer: the plain torch optimizer (not a `DistributedOptimizer`: gradients stay
            local).
        period: the steps between parameter averages (1: every step).
        group: the replicas that average together (default: the world).

    Raises:
        TypeError: `optimizer` is a DistributedOptimizer, or not a torch optimizer.
        ValueError: `period` is not a positive int, or this rank is not a member of `group`.
        LayoutMismatchError: the ranks' optimizers hold other parameters (each rank's named).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, period: int, group: Group | None = None) -> None:
        wrapper = owner_of(optimizer)
        if wrapper.role == "optimizer" and wrapper.optimizer() is not optimizer:
            raise TypeError(
                f"LocalSGD keeps gradients local: wrap the plain torch optimizer, not "
                f"{wrapper.describe()} (a wrapper that averages or shards would defeat the "
                f"period: pass its .optimizer)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LocalSGD wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive int (steps between averages), got {period!r}")
        if group is not None and group.rank < 0:
            raise ValueError(f"rank {runtime.rank()} is not a member of {group!r}")
        self.optimizer = optimizer
        splits.accounted_elsewhere(optimizer)  # this class records its steps itself
        self.period = period
        self.group = group
        self.local_steps = 0
        self._samples = RoundSamples(enabled=True)  # only to refuse uneven batches
        agree_layout("LocalSGD", describe_tensors(
            (f"group{g}.param{i}", p) for g, group_dict in enumerate(optimizer.param_groups)
            for i, p in enumerate(group_dict["params"])), group)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step locally; every `period`-th call, average the parameters over the ranks."""
        self._samples.update()
        if self._samples.weighted:
            weight, code = self._samples.weight, self._samples.code
            self._samples.reset()
            share = f"{weight:g} samples" if code == 1 else f"{weight * code:g} of {code} samples"
            raise ValueError(
                f"td.LocalSGD step {self.local_steps}: rank {runtime.rank()}'s batch was uneven "
                f"({share}; the ranks' batches differ), and LocalSGD averages parameters, not "
                f"gradients, so it cannot weight each rank by its samples: every rank would count "
                f"1/{group_size(self.group)} (another result than one process). Give every rank "
                f"equal batches: td.partition_dataset(..., pad=True) or drop_last=True (and no "
                f"td.samples(n)), or use td.DistributedOptimizer, which weights them")
        loss = self.optimizer.step(closure)
        self.local_steps += 1
        comm_s = 0.0
        if self.local_steps % self.period == 0:
            start = time.perf_counter()
            self.average()
            comm_s = time.perf_counter() - start
        steps.step_done(comm_s)  # what `tandem scale` and MetricLogger(timing=True) read
        return loss

    def average(self) -> None:
        """Replace every parameter by its mean over the ranks now (collective)."""
        size = group_size(self.group)
        if size == 1:
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        backend = runtime.get_backend()
        timeout = runtime.state().timeout

        def mean(flat: torch.Tensor) -> None:
            # Layouts were agreed at construction: call the backend directly when we can.
            if backend.supports_device(flat.device) and flat.is_floating_point():
                direct.allreduce_into(flat, "sum", self.group)[0].wait(timeout)
                flat.div_(size)
            else:
                collectives.allreduce(flat, op="mean", inplace=True, group=self.group)

        coalesced(params, mean)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "local_steps": self.local_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.local_steps = int(state_dict.get("local_steps", 0))


class LocalSGDOwner(WrapperOwner):
    """What model-wide calls ask of a LocalSGD run (`parallel/layout/owner.py`): replicas that
    differ between averagings, so no checkpoint of one copy per tensor."""

    kind = "LocalSGD"

    def describe(self) -> str:
        return f"{super().describe()} (period {self.obj.period})"

    def checkpoint_refusal(self) -> str:
        return ("a td.LocalSGD run cannot be checkpointed with td.Checkpointer / td.checkpoint.save_sharded: "
                "between its averagings every rank holds its own parameters and optimizer state, "
                "and a checkpoint keeps one copy of each tensor, so a restored run would go on from "
                "one replica (another run). Save every rank's own state instead, e.g. "
                "torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict()}, "
                "f'ckpt-rank{td.rank()}.pt'), and load it on the same number of ranks")


register(LocalSGD, LocalSGDOwner)
