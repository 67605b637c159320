"""One fully sharded unit: the parameters of one module, flat, padded and cut into N shards.

A unit owns the parameters of its module that no inner unit owns. They are laid end to end
in one flat space of `numel` elements, padded to N * shard_numel, and this rank keeps only
`shard` (an `nn.Parameter`, fp32 master, registered on the module as `_tandem_shard`: the
optimizer steps it). The original parameters leave the module; in their place each forward
puts views of the gathered flat tensor, so the module's own code runs unchanged.

The life of a step, per unit:
- pre-forward: all-gather the shards (already under way if the previous unit prefetched it),
  in `param_dtype`, through `_Gather` (an autograd function: its backward reduce-scatters);
  start the prefetch of the unit that ran next in the previous forward;
- post-forward: free the gathered storage (`resize_(0)`, as FSDP2 does: autograd's saved
  views keep their shape) unless this is the root, and hook the outputs so that their
  gradient's arrival gathers again;
- pre-backward: gather into the same storage, prefetch the unit before it;
- `_Gather.backward`: the full gradient's reduce-scatter (in `reduce_dtype`, sum, with an
  inf/NaN flag: `reduction.py`) starts and the gathered storage is freed; at the end of
  backward (an autograd callback, as DDP's) each is waited for and the mean lands in the
  shard's `.grad`, so `.grad` is complete when backward() returns.

The gathers and reduce-scatters are not checked one by one: the root's forward opens with one
agreement, and its backward with another (sent at the output's first gradient, finished before
the backward's first collective; see `parallel/operation_check.py`), so a rank that skipped a
backward or an optimizer step is named before its next all-gather meets another's reduce-scatter.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.groups import Group, group_rank, group_ranks, group_size
from tandem.parallel import model_check
from tandem.parallel.fully_shard import unit_agreement
from tandem.parallel.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, cast_floating
from tandem.parallel.fully_shard.reduction import GradientReduction
from tandem.parallel.layout import splits
from tandem.parallel.layout.flat_shard import FlatShard
from tandem.parallel.operation_check import OperationCheck

# module -> its Unit (FSDP2's `fully_shard.state(module)`), not an attribute on the module.
_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unit_of(module: nn.Module) -> Unit | None:
    """The fully_shard unit of `module` (None: not sharded)."""
    return _UNITS.get(module)


def attach(module: nn.Module, unit: Unit) -> None:
    _UNITS[module] = unit
SHARD = "_tandem_shard"
#: Module -> (a weak reference to) the module of the unit that took its parameters (an outer
#: one, when the root was sharded before its blocks).
_taken: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def taken_by(module: nn.Module) -> nn.Module | None:
    """The module of the unit that took `module`'s parameters (None: no unit did)."""
    return _taken.get(module, lambda: None)()


def _owned(module: nn.Module, prefix: str = ""):
    """(name, owner module, attribute, parameter) for the parameters no inner unit owns."""
    for attr, param in module._parameters.items():
        if param is not None:
            yield prefix + attr, module, attr, param
    for child_name, child in module._modules.items():
        if child is not None and unit_of(child) is None:
            yield from _owned(child, f"{prefix}{child_name}.")


class _Gather(torch.autograd.Function):
    """shard -> the gathered flat parameters; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: Unit) -> torch.Tensor:
        ctx.unit = unit
        return unit.wait_gathered()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.unit.reduce_gradient(grad), None


class Unit:
    def __init__(self, module: nn.Module, group: Group | None, policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool, has_inner: bool,
                 offload: CPUOffloadPolicy | None = None, replicate: Group | None = None) -> None:
        owned = list(_owned(module))
        seen: dict[int, str] = {}
        for name, _, _, param in owned:
            if id(param) in seen:
                raise ValueError(
                    f"fully_shard: parameter {name!r} is the same tensor as {seen[id(param)]!r} "
                    f"(tied weights); tie them inside one unit by sharing the module, or untie them")
            seen[id(param)] = name
        if not owned and not has_inner:
            raise ValueError(
                f"fully_shard: {type(module).__name__} has no parameters to shard; wrap a module "
                f"that has parameters")
        kinds = {(p.dtype, p.device) for _, _, _, p in owned}
        self.on_meta = any(p.device.type == "meta" for _, _, _, p in owned)  # td.fsdp.materialize's
        if len(kinds) > 1:
            found = ", ".join(f"{n} {tuple(p.shape)} {p.dtype} on {p.device}" for n, _, _, p in owned)
            raise ValueError(f"fully_shard: a unit's parameters need one dtype and device; found {found}")
        # Once, before the broadcast, other models and settings are named (an elastic newcomer's: no one's).
        if not runtime.joins_running_job():
            unit_agreement.agree(f"fully_shard of {type(module).__name__}", [(n, p) for n, _, _, p in owned],
                                 policy, offload, reshard_after_forward, group, replicate)
        self.module = module
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.names = [name for name, _, _, _ in owned]
        self.shapes = [tuple(p.shape) for _, _, _, p in owned]
        self._slots = [(owner, attr) for _, owner, attr, _ in owned]
        self.numel = sum(p.numel() for _, _, _, p in owned)
        self.space = FlatShard(self.numel, self.size, self.rank)  # ZeroOptimizer's arithmetic too
        self.shard_numel = self.space.shard_numel
        self.policy, self.param_dtype, self.offload = policy, policy.param_dtype, offload
        # reduce_dtype None: the shard's (fp32). HSDP: all-reduced over the replicas too.
        self.reduction = GradientReduction(self.size, group, replicate,
                                           policy.reduce_dtype or policy.param_dtype)
        self.replicate = self.reduction.replicate
        self.compute_device: torch.device | None = None  # where forward runs (set with the shard)
        self.reshard_after_forward = reshard_after_forward
        self.check: OperationCheck | None = None
        self.requires_gradient_sync = True
        self.order: list[Unit] = []  # the root's record of the units' forward order
        self._recording = False
        self._full: torch.Tensor | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._backward_ready = False
        self._root: Unit | None = None
        self._in_flight: list[Unit] = []  # (a root's) units whose reduce-scatter is in flight
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        self.shard: nn.Parameter | None = None
        self.mesh: Any = None  # a DeviceMesh: the shard is a DTensor parameter (`dtensor.py`)
        if owned:  # else a root that only holds units: it orders them and prefetches the first
            self._make_shard(module, owned)
        self.is_root = True  # until an outer fully_shard takes this module in

    @property
    def is_root(self) -> bool:
        return self._is_root

    @is_root.setter
    def is_root(self, value: bool) -> None:
        """A root owns the agreement that opens each forward and backward of its units."""
        self._is_root = value
        self.check = None
        if value:
            units = [unit_of(m) for m in self.module.modules() if unit_of(m) not in (None, self)]
            units.append(self)
            lines = [f"{n} {s}" for u in units for n, s in zip(u.names, u.shapes, strict=True)]
            shards = [u.shard for u in units if u.shard is not None]
            # HSDP (a mesh of replicas x shards, the whole world): every rank takes part.
            group = None if self.replicate is not None else self.group
            self.check = OperationCheck.make("fully_shard", type(self.module).__name__, lines,
                                             group, shards)
        model_check.register(self.module, self.check)

    def _make_shard(self, module: nn.Module, owned: list) -> None:
        dtype, device = owned[0][3].dtype, owned[0][3].device
        self.param_dtype = self.param_dtype or dtype
        group = self.group
        if self.on_meta:  # shapes only: `td.fsdp.materialize` gives the shard its values
            self.set_shard(torch.empty(self.shard_numel, dtype=dtype, device="meta"))
        else:
            from tandem.comm.collectives import user as collectives
            with torch.no_grad():
                flat = torch.zeros(self.size * self.shard_numel, dtype=dtype, device=device)
                torch.cat([p.detach().reshape(-1) for _, _, _, p in owned], out=flat[: self.numel])
                if self.size > 1 and not runtime.joins_running_job():  # rank 0's values, as DDP
                    collectives.broadcast(flat, root=group_ranks(group)[0], inplace=True, group=group)
                shard = flat[self.rank * self.shard_numel :][: self.shard_numel].clone()
                del flat
                if self.replicate is not None:  # and every replica from the first one's
                    collectives.broadcast(shard, root=group_ranks(self.replicate)[0], inplace=True,
                                          group=self.replicate)
            self.set_shard(shard)
        for (owner, attr), (_, _, _, old) in zip(self._slots, owned, strict=True):
            splits.mark(old, splits.REPLACED)  # an optimizer built before fully_shard holds these
            del owner._parameters[attr]
            if owner is not module:
                _taken[owner] = weakref.ref(module)
        self._placeholders()

    def set_shard(self, values: torch.Tensor) -> None:
        """`values` become this rank's shard: a new parameter on the module, in host memory when
        offloaded, computed on where the values are (on the offload's `td.device()`)."""
        meta = values.device.type == "meta"
        self.compute_device = None if meta else values.device
        if self.offload is not None and not meta:
            here = runtime.device() if runtime.is_initialized() else values.device
            self.compute_device = here if values.device.type == "cpu" else values.device
            pin = self.offload.pin_memory and torch.cuda.is_available()
            values = values.to("cpu").pin_memory() if pin else values.to("cpu")
        if self.mesh is not None:  # tandem.fsdp.fully_shard: FSDP2's DTensor parameter
            values = self.as_dtensor(values)
        self.shard = nn.Parameter(values)
        if self.size > 1 or self.group is None:  # clip_grad_norm_ reduces over the group
            splits.mark(self.shard, splits.FULLY_SHARD, self.group)
        self.module.register_parameter(SHARD, self.shard)

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's part of the flat space, same storage) as a DTensor sharded
        Shard(0) over the unit's mesh: the padded flat space is its global tensor."""
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.mesh, (Shard(0),), run_check=False,
                                  shape=torch.Size((self.size * self.shard_numel,)), stride=(1,))

    def local_shard(self) -> torch.Tensor:
        """This rank's shard as a plain tensor (the DTensor parameter's local tensor)."""
        shard = self.shard
        return shard._local_tensor if self.mesh is not None else shard

    # -- the unit's range in the flat space ------------------------------------------------------
    def my_range(self) -> tuple[int, int]:
        """[lo, hi) of this rank's shard, clipped to the real (unpadded) elements."""
        return self.space.my_range()

    def _placeholders(self) -> None:
        """Shape-only stand-ins between forwards: using one outside forward fails clearly."""
        for (owner, attr), shape in zip(self._slots, self.shapes, strict=True):
            setattr(owner, attr, torch.empty(shape, device="meta"))

    # -- communication -------------------------------------------------------------------------
    def start_gather(self, into: torch.Tensor | None = None) -> None:
        """Start the all-gather of the shards (async); `into` reuses a freed storage."""
        if self._pending is not None:
            return
        if into is None:
            into = torch.empty(self.size * self.shard_numel, dtype=self.param_dtype,
                               device=self.compute_device)
        else:
            # Back into the freed storage that autograd's saved views point at, through an
            # alias of its own: writing through it leaves their version counters alone.
            storage = into.untyped_storage()
            if storage.size() == 0:
                storage.resize_(into.numel() * into.element_size())
            into = torch.empty(0, dtype=into.dtype, device=into.device).set_(
                storage, into.storage_offset(), into.shape)
        source = self.local_shard().detach().to(self.param_dtype)  # host memory when offloaded
        if self.size == 1:
            into.copy_(source, non_blocking=True)
            self._pending = (None, into)
            return
        work, out, _ = direct.allgather_into(into, source, self.group)
        self._pending = (work, into if out is into else (into, out))

    def wait_gathered(self) -> torch.Tensor:
        if self._pending is None:  # a fresh tensor: autograd makes it _Gather's output
            self.start_gather()
        work, target = self._pending
        self._pending = None
        if work is not None:
            work.wait(runtime.state().timeout)
        if isinstance(target, tuple):
            target[0].copy_(target[1])
            target = target[0]
        return target

    def freed(self) -> bool:
        return self._full is not None and self._full.untyped_storage().size() == 0

    def free(self) -> None:
        if self._full is not None and not self.freed():
            self._full.untyped_storage().resize_(0)

    def reduce_gradient(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Start the reduction of the unit's gradient (`reduction.py`); None: `_Gather` gives
        the shard no gradient of its own, the reduction writes it at the end of backward."""
        self._backward_check()
        self.free()
        self._backward_ready = False
        if not self.reduction.start(grad, self.local_shard(), self.requires_gradient_sync):
            return None
        # Waited for at the end of backward, so it overlaps the backward of the units before.
        owner = self._root if self._root is not None else self
        if not owner._in_flight:
            torch.autograd.Variable._execution_engine.queue_callback(owner.finish_reductions)
        owner._in_flight.append(self)
        return None

    def finish_reductions(self) -> None:
        """End of backward (an autograd callback on the root): every reduce-scatter its units
        issued, waited for in the order issued, each one's all-reduce over the replicas (HSDP)
        started as it is; then each shard's averaged gradient in place."""
        in_flight, self._in_flight = self._in_flight, []
        for unit in in_flight:
            unit.reduction.to_replicas()
        for unit in in_flight:
            unit.reduction.finish(unit.shard, unit.mesh)

    # -- hooks -----------------------------------------------------------------------------------
    def _set_views(self, full: torch.Tensor) -> None:
        offset = 0
        for (owner, attr), shape in zip(self._slots, self.shapes, strict=True):
            n = math.prod(shape)
            setattr(owner, attr, full[offset : offset + n].view(shape))
            offset += n

    def _backward_starts(self) -> None:
        """The root's output got its first gradient: send the backward's agreement, finished
        before its first collective, or at the end of a backward that makes none."""
        self.check.backward_starts()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_check)

    def _backward_check(self) -> None:
        """Before a collective of backward: the root's backward agreement is finished (once)."""
        root = self if self.is_root else self._root
        if root is not None and root.check is not None:
            root.check.before_backward_collective()

    @torch.compiler.disable  # both hooks stay eager under torch.compile (docs/compile.md)
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict) -> Any:
        if self.on_meta:
            raise RuntimeError(
                f"fully_shard: {type(module).__name__} was built on the meta device and its "
                f"parameters ({', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''}) "
                f"have no values yet. After the fully_shard calls, run "
                f"`td.fsdp.materialize(model, seed=...)` (each module's reset_parameters(), or "
                f"init=fn), which gives each rank its shard of the one-process initialisation")
        # Reductions left by a backward that raised: keep the collectives in step.
        (self._root if self._root is not None else self).finish_reductions()
        if self.is_root:
            if self.check is not None:  # every rank is in this same forward, or all raise
                self.check.forward_starts()
            _running.root = self
            self._recording = not self.order
            for unit in self.order:  # a prefetch the last forward did not use: stale now
                if unit._pending is not None:
                    unit.wait_gathered()
        elif torch.is_grad_enabled():
            self._backward_check()  # a forward recomputed in backward (activation checkpointing)
        root = getattr(_running, "root", None)
        if root is not None and self is not root:
            if root._recording:
                root.order.append(self)
            self._root = root
        if self.shard is not None:
            full = _Gather.apply(self.shard, self)
            # A no_grad evaluation forward before a training forward's backward must not replace
            # the storage record that backward gathers into again.
            if torch.is_grad_enabled() or not self._backward_ready:
                self._full = full
            self._set_views(full)
        if root is not None and not root._recording and self in root.order:
            index = root.order.index(self)
            if index + 1 < len(root.order):
                root.order[index + 1].start_gather()
        elif root is self and self.order:
            self.order[0].start_gather()
        if self.policy.cast_forward_inputs and self.param_dtype is not None:
            return cast_floating((args, kwargs), self.param_dtype)
        return None

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.policy.output_dtype is not None:
            output = cast_floating(output, self.policy.output_dtype)
        if self.is_root:
            self._recording = False
            _running.root = None
            if self.check is not None:  # sent at the output's first gradient (see _backward_check)
                model_check.expect_backward_of(self.check, output, self._backward_starts)
        if self.shard is None:
            return output
        training = torch.is_grad_enabled() and self.shard.requires_grad
        if not training:
            if not self._backward_ready:
                self._full = None
            self._placeholders()
        elif self.reshard_after_forward and not self.is_root:
            self.free()
        if training:
            self._backward_ready = True
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if not self._backward_ready:
            return
        self._backward_ready = False  # the first output's gradient gathers; the others pass
        self._backward_check()
        if self.freed():
            self.start_gather(self._full)
        if self._pending is not None:  # gathered now, or prefetched by the unit after it
            self.wait_gathered()
        root = self._root
        if root is not None and self in root.order:
            index = root.order.index(self)
            if index > 0 and root.order[index - 1].freed():
                previous = root.order[index - 1]
                previous.start_gather(previous._full)


# The root unit whose forward is running in this thread: its inner units record their order
# under it during the first forward.
_running = threading.local()
