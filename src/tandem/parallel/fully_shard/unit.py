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
- `_Gather.backward`: the full gradient's reduce-scatter (fp32, sum) starts and the gathered
  storage is freed; at the end of backward (an autograd callback, as DDP's) each is waited for
  and the mean lands in the shard's `.grad`, so `.grad` is complete when backward() returns.

A flag element rides with every reduce-scatter: whether any rank saw inf/NaN. Each rank puts
inf into its shard's gradient when one did, so GradScaler's `unscale_` finds inf on every rank
and all ranks skip the same step, with no extra call and no host sync.

The gathers and reduce-scatters are not checked one by one: the root's forward opens with one
agreement, and its backward with another (sent at the output's first gradient, finished before
the backward's first collective; see `parallel/model_check.py`), so a rank that skipped a
backward or an optimizer step is named before its next all-gather meets another's
reduce-scatter.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tandem import runtime
from tandem.comm import agreement
from tandem.comm.backend import on_wire
from tandem.comm.groups import Group, group_rank, group_ranks, group_size
from tandem.parallel import model_check, splits
from tandem.parallel.flat_shard import FlatShard
from tandem.parallel.split_grads import as_split_grad

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
    def __init__(self, module: nn.Module, group: Group | None, param_dtype: torch.dtype | None,
                 reshard_after_forward: bool, has_inner: bool) -> None:
        _refuse_taken(module)
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
        if len(kinds) > 1:
            found = ", ".join(f"{n} {tuple(p.shape)} {p.dtype} on {p.device}" for n, _, _, p in owned)
            raise ValueError(f"fully_shard: a unit's parameters need one dtype and device; found {found}")
        # Once, before the broadcast: ranks that built different models are told so by name.
        agreement.agree_layout(f"fully_shard of {type(module).__name__}",
                               agreement.describe_tensors((n, p) for n, _, _, p in owned), group)
        self.module = module
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.names = [name for name, _, _, _ in owned]
        self.shapes = [tuple(p.shape) for _, _, _, p in owned]
        self._slots = [(owner, attr) for _, owner, attr, _ in owned]
        self.numel = sum(p.numel() for _, _, _, p in owned)
        self.space = FlatShard(self.numel, self.size, self.rank)  # ZeroOptimizer's arithmetic too
        self.shard_numel = self.space.shard_numel
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.check: model_check.ModelCheck | None = None
        self.requires_gradient_sync = True
        self.order: list[Unit] = []  # the root's record of the units' forward order
        self._recording = False
        self._full: torch.Tensor | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._unsynced: torch.Tensor | None = None
        self._backward_ready = False
        self._root: Unit | None = None
        self._in_flight: list[Unit] = []  # (a root's) units whose reduce-scatter is in flight
        self._reducing: tuple[Any, torch.Tensor] | None = None
        self._reducing_input: torch.Tensor | None = None
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        self.shard: nn.Parameter | None = None
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
            units = [unit_of(m) for m in self.module.modules() if unit_of(m) is not None]
            units.append(self)
            lines = [f"{n} {s}" for u in units for n, s in zip(u.names, u.shapes, strict=True)]
            shards = [u.shard for u in units if u.shard is not None]
            self.check = model_check.ModelCheck.make("fully_shard", type(self.module).__name__,
                                                     lines, self.group, shards)
        model_check.register(self.module, self.check)

    def _make_shard(self, module: nn.Module, owned: list) -> None:
        dtype, device = owned[0][3].dtype, owned[0][3].device
        self.param_dtype = self.param_dtype or dtype
        group = self.group
        with torch.no_grad():
            flat = torch.zeros(self.size * self.shard_numel, dtype=dtype, device=device)
            torch.cat([p.detach().reshape(-1) for _, _, _, p in owned], out=flat[: self.numel])
            if self.size > 1:  # every rank starts from rank 0's values, as DDP does
                from tandem.comm import collectives
                collectives.broadcast(flat, root=group_ranks(group)[0], inplace=True, group=group)
            lo = self.rank * self.shard_numel
            self.shard = nn.Parameter(flat[lo : lo + self.shard_numel].clone())
        del flat
        splits.mark(self.shard, splits.FULLY_SHARD, group)  # clip_grad_norm_ reduces over it
        for (owner, attr), (_, _, _, old) in zip(self._slots, owned, strict=True):
            splits.mark(old, splits.REPLACED)  # an optimizer built before fully_shard holds these
            del owner._parameters[attr]
            if owner is not module:
                _taken[owner] = weakref.ref(module)
        self._placeholders()
        module.register_parameter(SHARD, self.shard)

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
                               device=self.shard.device)
        else:
            # Back into the freed storage that autograd's saved views point at, through an
            # alias of its own: writing through it leaves their version counters alone.
            storage = into.untyped_storage()
            if storage.size() == 0:
                storage.resize_(into.numel() * into.element_size())
            into = torch.empty(0, dtype=into.dtype, device=into.device).set_(
                storage, into.storage_offset(), into.shape)
        source = self.shard.detach().to(self.param_dtype)
        if self.size == 1:
            into.copy_(source)
            self._pending = (None, into)
            return
        backend = runtime.get_backend()
        out = on_wire(into, backend, keep_values=False)
        work = backend.allgather_into(out, on_wire(source, backend), self.group)
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
        """The averaged gradient of this rank's shard (None while gradient sync is off)."""
        grad = grad.to(self.shard.dtype)
        self._backward_check()
        self.free()
        self._backward_ready = False
        if not self.requires_gradient_sync:
            self._unsynced = grad.clone() if self._unsynced is None else self._unsynced.add_(grad)
            return None
        if self._unsynced is not None:
            grad, self._unsynced = self._unsynced.add_(grad), None
        n, s = self.size, self.shard_numel
        packed = torch.empty(n, s + 1, dtype=grad.dtype, device=grad.device)
        packed[:, :s].copy_(grad.view(n, s))
        packed[:, s] = torch.isfinite(grad).all().logical_not().to(grad.dtype)
        work, out = None, packed[0]
        if n > 1:
            backend = runtime.get_backend()
            out = on_wire(torch.empty(s + 1, dtype=grad.dtype, device=grad.device), backend,
                          keep_values=False)
            source = on_wire(packed, backend).view(-1)
            work = backend.reducescatter_into(out, source, "sum", self.group)
            self._reducing_input = source  # alive until the reduce-scatter is done
        # Waited for at the end of backward, so it overlaps the backward of the units before.
        self._reducing = (work, out)
        owner = self._root if self._root is not None else self
        if not owner._in_flight:
            torch.autograd.Variable._execution_engine.queue_callback(owner.finish_reductions)
        owner._in_flight.append(self)
        return None

    def finish_reductions(self) -> None:
        """End of backward (an autograd callback on the root): every reduce-scatter its units
        issued, waited for in the order issued; each shard's averaged gradient in place."""
        while self._in_flight:
            self._in_flight.pop(0).finish_reduction()

    def finish_reduction(self) -> None:
        """Wait for the reduce-scatter; the averaged gradient goes into (or onto) `shard.grad`."""
        work, out = self._reducing
        self._reducing = self._reducing_input = None
        if work is not None:
            work.wait(runtime.state().timeout)
        out = out.to(self.shard.device)
        s = self.shard_numel
        shard_grad = out[:s].div_(self.size)
        shard_grad[:1].add_(torch.where(out[s] > 0, float("inf"), 0.0))
        if self.shard.grad is None:  # torch's norms of it are the unit's global norm
            self.shard.grad = as_split_grad(shard_grad, splits.split_of(self.shard))
        else:
            self.shard.grad.add_(shard_grad)

    # -- hooks -----------------------------------------------------------------------------------
    def _set_views(self, full: torch.Tensor) -> None:
        offset = 0
        for (owner, attr), shape in zip(self._slots, self.shapes, strict=True):
            n = 1
            for d in shape:
                n *= d
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
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        (self._root if self._root is not None else self).finish_reductions()  # of a raised backward
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

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
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


def _refuse_taken(module: nn.Module) -> None:
    """Sharding a block after its root took the block's parameters: say which order works."""
    subtree = {id(m) for m in module.modules()}
    for sub in module.modules():
        outer = _taken.get(sub, lambda: None)()
        if outer is not None and id(outer) not in subtree:  # not an inner unit's
            which = "" if sub is module else f" (its {type(sub).__name__}'s)"
            raise ValueError(
                f"fully_shard({type(module).__name__}): its parameters{which} already belong to "
                f"the unit of {type(outer).__name__}, which was sharded first. Apply "
                f"fully_shard to the inner blocks first, then the root: `for block in "
                f"model.blocks: td.fully_shard(block)`, then `td.fully_shard(model)`")
