"""Synchronous data parallelism: `DistributedOptimizer` and `DistributedDataParallel`.

    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

Gradients are averaged across the group *during* backward (see `reducer.py`), and when
`backward()` returns every `.grad` holds the average (DDP's contract): clipping, GradScaler,
logging gradients and `zero_grad()` behave as in one process. `step()` steps the wrapped
optimizer. Both classes are thin fronts over the same `Reducer`. In a group of one they add
nothing: no hooks, no buffers.

Each `step()` records a `StepStats` (wall time of the iteration, time blocked on
communication, time in the inner optimizer) with `time.perf_counter` only, no device
synchronisation; `opt.last_step_stats` has the latest. The step also reports its
communication wait to `tandem.diagnostics.steps` (what `tandem scale` reads) and, when
`TANDEM_TIMELINE` is set, draws the optimizer step and the reductions on the timeline.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.collectives.tensors import coalesced
from tandem.comm.groups import Group, group_ranks, group_size
from tandem.diagnostics import steps, timeline
from tandem.parallel.data_parallel.buckets import DEFAULT_FIRST_CAP_BYTES
from tandem.parallel.data_parallel.comm_hooks import CommHook, describe
from tandem.parallel.data_parallel.compile_split import BucketCaps, bucket_boundaries, call_module, stand_for
from tandem.parallel.data_parallel.compression import make_comm_hook
from tandem.parallel.data_parallel.reducer import Reducer
from tandem.parallel.data_parallel.reducer_front import MB as _MB
from tandem.parallel.data_parallel.reducer_front import (
    check_common,
    leave,
    ordered_named_params,
    rejoin,
    unsynced,
)
from tandem.parallel.data_parallel.step_clock import StepClock, StepStats
from tandem.parallel.layout import splits
from tandem.parallel.layout.owner import ModuleOwner, WrapperOwner, register


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that `step()` uses gradients averaged across the group.

    A composition, not a generated subclass: it holds `optimizer` and forwards `param_groups`,
    `state`, `state_dict()` and `load_state_dict()` to it. It derives from
    `torch.optim.Optimizer` only so that LR schedulers accept it; the base class's constructor
    is not run.

    When `backward()` returns, the gradients are averaged: clip them, unscale them
    (`GradScaler`), read or log them as in one process. `synchronize()` and
    `skip_synchronize()` exist for Horovod scripts (`opt.synchronize(); clip; with
    opt.skip_synchronize(): opt.step()`); here they have nothing left to do.

    Args:
        optimizer: the torch optimizer to wrap (not a fully_shard model's: its gradients are
            reduced in backward already).
        named_parameters: the model's `named_parameters()`, so that errors name parameters
            (None: "param0", "param1", ...).
        op: "mean" (default) or "sum".
        compression: None, "fp16", "bf16", "powersgd", or a hook (`comm_hooks.py`: the
            contract; `compression.py`: the built-in hooks).
        bucket_mb: the bucket cap in MB (25).
        accumulate: reduce once every k backward passes (call `step()` after the k-th);
            `no_sync()` does the same for the passes inside it. A `step()` after fewer passes
            reduces what has been accumulated (the last, short window of an epoch) with a
            warning.
        group: the data-parallel group (default: the world).
        first_bucket_mb: the first bucket's cap in MB (1), so that communication starts early.

    Raises:
        TypeError: `optimizer` is not a torch optimizer, is already a DistributedOptimizer, or
            holds fully_shard shards; `named_parameters` is not (name, parameter) pairs.
        ValueError: an op other than "mean"/"sum", a bucket cap <= 0, `accumulate` < 1, a
            `named_parameters` that misses some of the optimizer's parameters, or this rank not
            a member of `group`.
        GradientLayoutError: the ranks built other models or options (each rank's named).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        op: str = "mean",
        compression: str | CommHook | None = None,
        bucket_mb: float = 25,
        accumulate: int = 1,
        group: Group | None = None,
        first_bucket_mb: float = DEFAULT_FIRST_CAP_BYTES / _MB,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
        if any(splits.kind_of(p) == splits.FULLY_SHARD for g in optimizer.param_groups for p in g["params"]):
            raise TypeError("these parameters are td.fully_shard shards, whose gradients are reduced "
                            "in backward already: give them to the plain torch optimizer, unwrapped")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"accumulate must be an integer >= 1 (backward passes per step), got {accumulate!r}")
        check_common(op, bucket_mb, first_bucket_mb, group, "DistributedOptimizer")
        self.optimizer = optimizer
        splits.accounted_elsewhere(optimizer)  # this class records its steps itself
        splits.accounted_elsewhere(self)
        self.accumulate = accumulate
        self.group = group
        self._clock = StepClock()
        timeline.configure()
        self._skip_sync = False
        self._wait_s = 0.0  # communication waited for since the last step
        self._warned_short = False
        named = ordered_named_params(optimizer, named_parameters)

        def reducer() -> Reducer | None:
            if group_size(group) == 1:
                stand_for(self, None)  # (an elastic world of one) nothing to overlap
                return None
            hook = make_comm_hook(compression)
            built = Reducer(
                named, op=op, comm_hook=hook, cap_bytes=int(bucket_mb * _MB),
                first_cap_bytes=int(first_bucket_mb * _MB), accumulate=accumulate, group=group,
                on_round_end=self._round_done, owner="DistributedOptimizer",
                options=f"op={op} accumulate={accumulate} compression={describe(hook)}",
            )
            # A compiled model is cut at the buckets, to overlap still (compile_split.py).
            stand_for(self, BucketCaps.of_reducer(built))
            return built

        self._make_reducer = reducer
        self._reducer: Reducer | None = reducer()

    # -- what torch code expects of an optimizer ------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "DistributedOptimizer fixes its gradient buckets when it is built: add every param group "
            "to the inner optimizer first, then wrap it"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    @property
    def last_step_stats(self) -> StepStats | None:
        """Timing of the latest step (see `StepStats`)."""
        return self._clock.last

    # -- the data-parallel part -----------------------------------------------------------
    def _round_done(self, wait_s: float) -> None:
        self._wait_s += wait_s

    def synchronize(self) -> None:
        """Average what is still local (a short accumulation window, passes inside `no_sync()`);
        a no-op when backward() has already averaged every gradient."""
        self._finish_open_round()

    def _finish_open_round(self) -> None:
        """Called by step() and synchronize() only: the warning points at their caller."""
        reducer = self._reducer
        if reducer is not None and reducer.round_open():
            self._warn_short_window(reducer)
            reducer.finish_round()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's `with opt.skip_synchronize(): opt.step()`: step without reducing again.

        Gradients are averaged when backward() returns, so a step never reduces twice anyway;
        inside this block it does not even average a still-open window (Horovod's meaning).
        """
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer on the averaged gradients."""
        if closure is not None:
            raise ValueError(
                f"DistributedOptimizer.step() takes no closure ({type(self.optimizer).__name__}'s "
                f"step calls one): gradients are averaged once per step, and a closure would run "
                f"backward again after that. Wrap the model instead, "
                f"td.DistributedDataParallel(model), and step the plain optimizer: every "
                f"backward the closure runs is averaged"
            )
        if timeline.ENABLED:
            timeline.step_started()  # backward is over
        reducer = self._reducer
        if not self._skip_sync:
            self._finish_open_round()
        wait_s, self._wait_s = self._wait_s, 0.0
        start = time.perf_counter_ns()
        result = self.optimizer.step()
        if reducer is not None and reducer.step_check is not None:
            reducer.step_check.steps += 1  # a rank that skips a step is named at the next round
        end = time.perf_counter_ns()
        if timeline.ENABLED:
            timeline.complete("optimizer step", start, end)
        self._clock.record(end * 1e-9, wait_s, (end - start) * 1e-9,
                           reducer.bytes_per_round if reducer else 0)
        # One reading of the clock serves both records; feeds `tandem scale`, which may end the
        # run there (SystemExit).
        steps.step_done(wait_s, now=end * 1e-9)
        return result

    def _warn_short_window(self, reducer: Reducer) -> None:
        if self.accumulate > 1 and reducer.max_passes < self.accumulate and not self._warned_short:
            self._warned_short = True
            warnings.warn(
                f"DistributedOptimizer(accumulate={self.accumulate}): step() after "
                f"{reducer.max_passes} backward pass(es); the gradients accumulated so far are "
                f"averaged now. Call step() once every {self.accumulate} passes (this warning is "
                f"shown once).",
                stacklevel=4,  # the user's step() or synchronize() call
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, like the wrapped optimizer's zero_grad(); legal anywhere.

        The one error: reductions still in flight, which only a backward() that raised half-way
        leaves behind (they read and write the gradient buffers in the background).
        """
        reducer = self._reducer
        if reducer is not None:
            if reducer.has_pending():
                raise RuntimeError(
                    "DistributedOptimizer.zero_grad(): a backward() that did not finish left gradient "
                    "reductions in flight, and clearing the gradients now would race with them. "
                    "Call opt.synchronize() first (every rank must), or end the job."
                )
            reducer.reset_window()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside only accumulate locally; the next one outside reduces them all."""
        return unsynced(self._reducer)


class DistributedDataParallel(nn.Module):
    """A module wrapper over the same reducer: gradients are averaged when backward() returns.

    Like torch's DDP: the root's parameters and buffers are copied to every rank at
    construction; with `broadcast_buffers` (the default) buffers (e.g. BatchNorm statistics)
    are copied from the root again before each *training* forward (`train()` mode, grad
    enabled, outside `no_sync()`). A forward in `eval()` or under `torch.no_grad()` makes no
    collective, so evaluating on one rank, or on uneven data, never waits for the others.
    `no_sync()` skips the reduction for the passes inside it. Use any optimizer on
    `module.parameters()`.

    Args:
        module: the model to replicate.
        op: "mean" (default) or "sum".
        compression: None, "fp16", "bf16", "powersgd", or a hook, as for DistributedOptimizer.
        bucket_mb: the bucket cap in MB (25).
        first_bucket_mb: the first bucket's cap in MB (1).
        group: the data-parallel group (default: the world).
        broadcast_buffers: copy the root's buffers to every rank before each training forward.

    Raises:
        TypeError: `module` is not an `nn.Module`.
        ValueError: an op other than "mean"/"sum", a bucket cap <= 0, or this rank not a member
            of `group`.
        LayoutMismatchError: the ranks' modules hold other parameters or buffers (the copy of
            the root's values at construction names the first that differs).
        GradientLayoutError: the ranks built other models or options (each rank's named).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        op: str = "mean",
        compression: str | CommHook | None = None,
        bucket_mb: float = 25,
        first_bucket_mb: float = DEFAULT_FIRST_CAP_BYTES / _MB,
        group: Group | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        check_common(op, bucket_mb, first_bucket_mb, group, "DistributedDataParallel")
        self.module = module
        self.group = group
        self._root = group_ranks(group)[0]
        self._clock = StepClock()
        self._reducer: Reducer | None = None
        self._buffers_to_sync: list[torch.Tensor] = []
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._split: BucketCaps | None = None  # where a compiled forward is cut (compile_split.py)

        def reducer() -> Reducer | None:
            if group_size(group) == 1:
                return None
            self._buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
            hook = make_comm_hook(compression)
            built = Reducer(
                named, op=op, comm_hook=hook, cap_bytes=int(bucket_mb * _MB),
                first_cap_bytes=int(first_bucket_mb * _MB), group=group, on_round_end=self._round_done,
                owner="DistributedDataParallel", options=f"op={op} compression={describe(hook)}",
            )
            self._split = BucketCaps.of_reducer(built)
            return built

        if group_size(group) > 1:
            from tandem.parallel.broadcast import broadcast_parameters

            broadcast_parameters(module, root=self._root, group=group)
        self._make_reducer = reducer
        self._reducer = reducer()

    def _round_done(self, wait_s: float) -> None:
        reducer = self._reducer
        self._clock.record(time.perf_counter(), wait_s, 0.0, reducer.bytes_per_round if reducer else 0)
        steps.add_comm(wait_s)  # the model's optimizer's step counts it (`splits`' step hook)

    @property
    def last_step_stats(self) -> StepStats | None:
        return self._clock.last

    # Run by Python even under torch.compile (as torch's DDP does): its bookkeeping (a counter
    # that changes every step, collectives) would make dynamo recompile at every step or break
    # the graph. Dynamo compiles the inner module's forward instead, cut at the buckets.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        with bucket_boundaries(self._split):
            return call_module(self.module, args, kwargs)

    @torch.compiler.disable  # and all it calls: the buffers' broadcast goes through the engine
    def _before_forward(self) -> None:
        reducer = self._reducer
        if reducer is not None and reducer.has_pending():
            raise RuntimeError(
                "DistributedDataParallel: forward() while gradient reductions launched by a backward() "
                "that did not finish are still in flight; call model.synchronize() on every rank "
                "first (or end the job)")
        if reducer is not None and reducer.step_check is not None and self.training \
                and torch.is_grad_enabled():
            reducer.step_check.forwards += 1  # a rank that skips a backward is named at the next
        if self._buffers_to_sync and self._training_forward(reducer):
            self._sync_buffers()

    def _training_forward(self, reducer: Reducer) -> bool:
        """A forward whose backward will reduce: the only kind that communicates (as in DDP).

        Joined ranks (td.join) cannot answer a buffer broadcast, so buffers wait until after it.
        """
        return (self.training and torch.is_grad_enabled() and reducer.sync_enabled
                and not reducer.joining)

    def _sync_buffers(self) -> None:
        timeout = runtime.state().timeout

        def send(flat: torch.Tensor) -> None:
            work, wire = direct.broadcast_into(flat, self._root, self.group)
            work.wait(timeout)
            if wire is not flat:  # staged (a device the engine does not take): copied back
                flat.copy_(wire)

        with torch.no_grad():
            coalesced(self._buffers_to_sync, send, copy_back=runtime.rank() != self._root)

    def synchronize(self) -> None:
        """Average what is still local: passes made only inside `no_sync()`, or the rest of a
        backward() that raised half-way (then every rank must call it). A no-op otherwise."""
        if self._reducer is not None and self._reducer.round_open():
            self._reducer.finish_round()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside only accumulate locally; the next one outside reduces them all."""
        return unsynced(self._reducer)


# -- the owners (parallel/layout/owner.py): what model-wide calls ask of these wrappers -----------


class _ReducerOwner:
    """What both fronts of the reducer answer alike: sync on/off, a change of world, td.join."""

    obj: Any
    kind = "data parallel"
    answers_join = True

    def reducer(self) -> Reducer | None:
        return self.obj._reducer

    def describe(self) -> str:
        reducer = self.obj._reducer
        over = f"over {group_size(self.obj.group)} ranks" if reducer is not None else "(a world of one)"
        return f"td.{type(self.obj).__name__} {over}"

    def accounts_steps(self) -> bool:
        return True

    def leave(self) -> None:
        """This world is over (`tandem.elastic`): no more operations on it."""
        leave(self.obj)

    def rejoin(self) -> None:
        """The world changed (an elastic job's new round, `tandem.elastic`): reduce over it."""
        rejoin(self.obj, type(self.obj).__name__)


class DistributedOptimizerOwner(_ReducerOwner, WrapperOwner):
    def set_gradient_sync(self, on: bool) -> bool:
        reducer = self.obj._reducer
        if reducer is None or reducer.closed:
            return False
        reducer.set_sync(bool(on))
        return True

    def copy_from(self, root: int, group: Any) -> None:
        from tandem.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters

        reducer = self.obj._reducer
        if reducer is not None:
            broadcast_parameters(dict(reducer.named_parameters()), root=root, group=group)
            broadcast_optimizer_state(self.obj.optimizer, root=root, group=group)


class DistributedDataParallelOwner(_ReducerOwner, ModuleOwner):
    def copy_from(self, root: int, group: Any) -> None:
        from tandem.parallel.broadcast import broadcast_parameters

        if self.obj._reducer is not None:
            broadcast_parameters(self.obj.module, root=root, group=group)


register(DistributedOptimizer, DistributedOptimizerOwner)
register(DistributedDataParallel, DistributedDataParallelOwner)
