"""ZeRO stage 1: each rank keeps the optimizer state of only its shard of the parameters.

    opt = td.ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

All parameters are laid end to end in one flat space (group by group, in the optimizer's
order), padded to a multiple of the group size k and cut into k equal shards. A step:

1. packs the local gradients into one flat buffer and reduce-scatters it (mean): each rank
   receives the averaged gradient of its own shard only;
2. steps the wrapped optimizer, which has been re-pointed at this rank's shard (one flat
   tensor per param group, so per-group hyper-parameters still apply), so its state (Adam's
   two moments, SGD's momentum) exists for 1/k of the parameters;
3. all-gathers the updated shards and copies them into the model's parameters.

Communication equals one all-reduce (a reduce-scatter plus an all-gather), as in plain data
parallelism; optimizer memory per rank drops to ~1/k. A parameter that got no gradient on any
rank is stepped with a zero gradient (so weight decay and momentum still move it), where torch
would skip it.

**Shape-aware sharding.** Flat shards are exact for an optimizer that updates each element on
its own (SGD, Adam, ...). One that looks at a whole tensor but at one tensor at a time
(Adafactor's factored moments, Muon's orthogonalization, LAMB's trust ratio) gets *whole
parameters* instead (`parallel/layout/elementwise.py` decides): each parameter is owned whole by
one rank, balanced by size (largest first, onto the least loaded rank), and the flat space is
laid out by owner, rank r's parameters end to end in its shard, padded to the largest rank's
share. The same reduce-scatter then hands each owner the averaged gradient of its whole
parameters, the wrapped optimizer steps them in their own shapes (its param groups hold views
of this rank's shard shaped as the parameters), and the same all-gather sends the new values,
as torch's ZeroRedundancyOptimizer, DeepSpeed's ZeRO Muon and torchtitan's DistMuon do. Exact,
for a little padding on the wire (the largest share against the mean). An optimizer that
couples parameters (LBFGS) is refused with the reason.

**Uneven batches.** Each rank's shard carries one more element: this rank's weight in the
step (1, or its samples when `td.partition_dataset(pad=False)` or `td.samples(n)` reported an
uneven batch; see `parallel/data_parallel/samples.py`), summed by the same reduce-scatter. The
averaged gradient is the weighted sum divided by the summed weights: the one-process mean over
all samples, with no extra message. Under gradient accumulation (several backward passes per
step) each micro-batch is weighted by its own samples, as one process following torch's recipe
(each micro-batch's mean loss / M) would: when a micro-batch's weight differs from the one
before, what `.grad` holds is rescaled before the next backward adds to it
(`samples.WindowSamples`), so on uneven steps `.grad` is this rank's gradient times a factor.

**Where it differs from `DistributedOptimizer`:** the model's `.grad` stays this rank's own
gradient after backward() (the average exists only as shards, made in `step()`), so recipes
that read gradients between backward() and step() need its help: clip with
`opt.clip_grad_norm_(max_norm)` (the global norm of the averaged gradient), not
`nn.utils.clip_grad_norm_`. GradScaler's `unscale_` is not supported (each rank would see
inf in its own shard only and skip different steps): use bf16 autocast, which needs no scaler.
The model's gradients stay local (this class averages its shard only). The model's
parameters stay the source of truth: each step re-reads this rank's shard from
them, so loading a model state dict between steps is safe. `state_dict()` gathers the full,
ordinary optimizer state dict (collective: every rank must call it); `load_state_dict` takes
such a dict and keeps this rank's shard. LR schedulers want a torch `Optimizer`: give them
`opt.optimizer`, whose `param_groups` (and so `lr`) are the ones this class steps with.
To restore, every rank calls `load_state_dict` with the full dict (`td.load` returns it on
every rank); `td.broadcast_optimizer_state` is not needed.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tandem import runtime
from tandem.comm.agreement.agree import agree_layout, describe_tensors
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.groups import Group, group_rank, group_size
from tandem.diagnostics import steps
from tandem.parallel.data_parallel.samples import WindowSamples
from tandem.parallel.layout import owner as layout_owner
from tandem.parallel.layout import splits
from tandem.parallel.layout.elementwise import sharding
from tandem.parallel.layout.flat_shard import FlatShard
from tandem.parallel.layout.owner import WrapperOwner, register
from tandem.parallel.layout.pieces import Placement, per_element, whole
from tandem.parallel.layout.split_grads import mark_grads

_OWNERS = WeakIdKeyDictionary()  # parameter -> weakref to the ZeroOptimizer that holds it


def owner_of(param: torch.Tensor) -> ZeroOptimizer | None:
    """The ZeroOptimizer whose parameter this is (its gradient is averaged only by step())."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


class ZeroOptimizer:
    """Wrap a torch optimizer so that its state is sharded across the ranks of `group`.

    Build it right after the optimizer (and after `td.broadcast_parameters(model)`), on every
    rank. An optimizer that has already stepped keeps its state: it is resharded.

    Args:
        optimizer: the plain torch optimizer (not a `DistributedOptimizer`, nor one over
            fully_shard shards); all its parameters of one dtype and device.
        group: the ranks its state is sharded over (default: the world).
        elementwise: the user's word for an optimizer tandem cannot classify: True when its
            update treats each element on its own (any cut of the flat space), False when it
            treats each tensor on its own (each rank gets whole parameters); None: tandem
            decides.

    Raises:
        TypeError: `optimizer` is a DistributedOptimizer, not a torch optimizer, or holds
            fully_shard shards.
        ValueError: an optimizer whose update cannot be sharded to one process's result (use
            td.DistributedOptimizer, or say `elementwise=`), no parameter, parameters of several
            dtypes or devices, a parameter given twice, or this rank not a member of `group`.
        LayoutMismatchError: the ranks' optimizers hold other parameters (each rank's named).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Group | None = None, *,
                 elementwise: bool | None = None) -> None:
        wrapper = layout_owner.owner_of(optimizer)
        if wrapper.role == "optimizer" and wrapper.optimizer() is not optimizer:
            raise TypeError(
                f"ZeroOptimizer reduces gradients itself: wrap the plain torch optimizer, not "
                f"{wrapper.describe()} (pass the torch optimizer you gave it, its .optimizer)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if elementwise is not None:  # the user's word for an optimizer tandem cannot classify
            optimizer.elementwise = elementwise
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError(
                "SparseAdam under td.ZeroOptimizer: SparseAdam steps sparse gradients "
                "(nn.Embedding(sparse=True)), which ZeroOptimizer's flat reduce-scatter cannot "
                "carry. Use tandem.horovod's hvd.DistributedOptimizer(torch.optim.SparseAdam(...), "
                "named_parameters=...) (sparse gradients averaged densely and handed back sparse: "
                "the one-process result), or sparse=False with a dense optimizer such as AdamW "
                "under td.ZeroOptimizer")
        # "flat": any cut of the flat space; "whole": whole parameters per rank (shape-aware)
        self.sharding = sharding(optimizer, "td.ZeroOptimizer", "Use td.DistributedOptimizer "
                                 "(the optimizer state replicated, the one-process result), or "
                                 "td.DistributedDataParallel(model) with the plain optimizer "
                                 "for one whose step takes a closure")
        if any(splits.kind_of(p) == splits.FULLY_SHARD for g in optimizer.param_groups for p in g["params"]):
            raise TypeError("these parameters are td.fully_shard shards (optimizer state already 1/N "
                            "per rank): give them to the plain torch optimizer, unwrapped")
        if group is not None and group.rank < 0:
            raise ValueError(f"rank {runtime.rank()} is not a member of {group!r}")
        splits.refuse_mixing([(f"group{g}.param{i}", p) for g, pg in enumerate(optimizer.param_groups)
                              for i, p in enumerate(pg["params"])], group, "td.ZeroOptimizer")
        self.optimizer = optimizer
        splits.accounted_elsewhere(optimizer)  # this class records its steps itself
        for p in (q for g in optimizer.param_groups for q in g["params"]):
            _OWNERS[p] = weakref.ref(self)  # td.clip_grad_norm_(model) clips through this
            if p.requires_grad:  # torch's own clip_grad_norm_ is refused with the fix
                mark_grads(p, splits.Split(splits.ZERO, group))
        self.group = group
        # Uneven batches: each rank's micro-batches by their samples (samples.py).
        self._samples = WindowSamples(group_size(group), self._local_grads, self._active)
        self._params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        flat = [p for params in self._params for p in params]
        if not flat:
            raise ValueError("ZeroOptimizer needs an optimizer with at least one parameter")
        kinds = {(p.dtype, p.device) for p in flat}
        if len(kinds) > 1:
            found = ", ".join(f"{dtype} on {device}" for dtype, device in sorted(kinds, key=str))
            raise ValueError(
                f"ZeroOptimizer shards one flat space, so all parameters need one dtype and device; "
                f"found {found}. Keep fp32 master parameters on one device (e.g. model.float())."
            )
        if len({id(p) for p in flat}) != len(flat):
            raise ValueError("a parameter appears twice in the optimizer's param_groups")
        if not runtime.joins_running_job():  # whose ranks are not building one with it
            agree_layout("ZeroOptimizer", describe_tensors(
                (f"group{g}.param{i}", p) for g, params in enumerate(self._params)
                for i, p in enumerate(params)), group)
        previous = optimizer.state_dict() if len(optimizer.state) else None
        self._dtype, self._device = flat[0].dtype, flat[0].device
        self._partition()
        if previous is not None:
            self.load_state_dict(previous)

    def _partition(self) -> None:
        """Cut the flat space into this group's shards and point the wrapped optimizer at this
        rank's; its state starts empty (the caller loads it)."""
        optimizer = self.optimizer
        self._size, self._rank = group_size(self.group), group_rank(self.group)
        self._samples.size = self._size
        self._reduced = False  # clip_grad_norm_ reduced this step's gradients already
        self._flat: torch.Tensor | None = None
        # Natural offsets: the parameters end to end, group by group (the one-process order).
        self._natural: list[list[int]] = []
        self._group_ranges: list[tuple[int, int]] = []
        offset = 0
        for params in self._params:
            start = offset
            self._natural.append([])
            for p in params:
                self._natural[-1].append(offset)
                offset += p.numel()
            self._group_ranges.append((start, offset))
        self.numel = offset
        sizes = [p.numel() for p in self.parameters]
        if self.sharding == "whole":
            # Each parameter whole on one rank (largest first, onto the least loaded); the flat
            # space laid out by owner, padded to the largest share.
            self.owners, loads = balance(sizes, self._size)
            self.shard_numel = max(max(loads), 1)
            self.space = None
            filled = [0] * self._size
            layout = []
            for i, n in enumerate(sizes):
                r = self.owners[i]
                layout.append(r * self.shard_numel + filled[r])
                filled[r] += n
        else:
            self.owners = None
            self.space = FlatShard(offset, self._size, self._rank)
            self.shard_numel = self.space.shard_numel
            layout = [o for offsets in self._natural for o in offsets]
        at = iter(layout)  # where each parameter lies in the (padded) flat space on the wire
        self._offsets: list[list[int]] = [[next(at) for _ in params] for params in self._params]
        self._lo = self._rank * self.shard_numel
        self._hi = self._lo + self.shard_numel
        self._shard = torch.zeros(self.shard_numel, dtype=self._dtype, device=self._device)
        # The reduce-scatter's output: this rank's shard of the summed gradients, and one more
        # element, the summed weights of the ranks (their number, or their samples: uneven).
        self._wire_grad = torch.zeros(self.shard_numel + 1, dtype=self._dtype, device=self._device)
        self._shard_grad = self._wire_grad[: self.shard_numel]
        # The tensors the wrapped optimizer now steps (and keys its state by): one view of this
        # rank's shard per param group (flat), or one per parameter it owns, in its shape
        # (whole). Views, so stepping them updates `_shard` in place.
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._view_starts: list[int] = []
        self.owned: list[int] = []  # whole: the indices of the parameters this rank steps
        if self.sharding == "whole":
            index = 0
            for params, offsets, group_dict in zip(self._params, self._offsets,
                                                   optimizer.param_groups, strict=True):
                mine = []
                for p, o in zip(params, offsets, strict=True):
                    if self.owners[index] == self._rank:
                        a = o - self._lo
                        view = self._shard[a : a + p.numel()].view(p.shape)
                        grad = self._shard_grad[a : a + p.numel()].view(p.shape)
                        self._views.append((view, grad))
                        self._view_starts.append(a)
                        self.owned.append(index)
                        mine.append(view)
                    index += 1
                group_dict["params"] = mine
        else:
            for (start, end), group_dict in zip(self._group_ranges, optimizer.param_groups,
                                                strict=True):
                a = min(max(start - self._lo, 0), self.shard_numel)
                b = min(max(end - self._lo, 0), self.shard_numel)
                view, grad = self._shard[a:b], self._shard_grad[a:b]
                self._views.append((view, grad))
                self._view_starts.append(a)
                group_dict["params"] = [view]
        optimizer.state = defaultdict(dict)  # keyed by the old parameters or views

    # -- the optimizer interface -----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The model parameters, in the flat space's order."""
        return [p for params in self._params for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        for p in self.parameters:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch's Optimizer.zero_grad: a SplitGrad is an alias, which detach_() refuses
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def _reduce_gradients(self) -> torch.Tensor:
        """Reduce-scatter the local gradients: this rank's shard of their average. Returns the
        flat buffer, free for the parameters' all-gather."""
        flat = self._pack_gradients()
        wire = flat.view(self._size, self.shard_numel + 1)
        if self._samples.factor != 1.0:  # uneven micro-batches: this rank's by their samples
            wire.mul_(self._samples.factor)
        wire[:, self.shard_numel] = self._samples.divisor()
        self._samples.reset()
        self._communicate("reducescatter", self._wire_grad, flat)
        # The summed weights (the group's size on an even step): no host read.
        self._shard_grad.div_(self._wire_grad[self.shard_numel:])
        self._reduced = True
        return flat

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the *averaged* gradient by its global norm, as `nn.utils.clip_grad_norm_` would
        in one process; returns that norm. Call it between backward() and step().

        The model's `.grad` is this rank's own gradient until `step()` (see the module
        docstring), so `nn.utils.clip_grad_norm_(model.parameters())` would clip the wrong
        thing. This reduce-scatters now (step() then does not again), and the norm is one
        all-reduce of the shards' partial sums.
        """
        if not self._reduced:
            self._flat = self._reduce_gradients()
        grad = self._shard_grad
        if norm_type == float("inf"):
            local = grad.abs().max() if grad.numel() else grad.new_zeros(())
            total = collectives.allreduce(local.reshape(1), op="max", group=self.group)[0]
        else:
            local = grad.abs().pow(norm_type).sum().reshape(1)
            total = collectives.allreduce(local, op="sum", group=self.group)[0].pow(1.0 / norm_type)
        grad.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average gradients, step this rank's shard, and gather the new parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._reduced and self._flat is not None:
            flat, self._flat = self._flat, None
        else:
            flat = self._reduce_gradients()
        self._reduced = False
        self._read_shard()
        with torch.no_grad():
            for view, grad in self._views:
                view.grad = grad
            self.optimizer.step()
        gathered = flat[: self.shard_numel * self._size]  # the packed buffer, free again
        self._communicate("allgather", gathered, self._shard)
        self._write_parameters(gathered)
        steps.step_done()  # what `tandem scale` and MetricLogger(timing=True) read
        return loss

    # -- the flat space ----------------------------------------------------------------------
    def _local_grads(self):
        """The gradients backward accumulates into (rescaled within a window: samples.py)."""
        return (p.grad for params in self._params for p in params if p.grad is not None)

    def _active(self) -> bool:
        """Whether this is still the ZeroOptimizer of its parameters (not an earlier loop's)."""
        return owner_of(self._params[0][0]) is self

    def _pieces(self):
        """(param, its flat offset) for every parameter, group by group."""
        for params, offsets in zip(self._params, self._offsets, strict=True):
            yield from zip(params, offsets, strict=True)

    def _pack_gradients(self) -> torch.Tensor:
        """The local gradients in the reduce-scatter's layout: each rank's shard followed by
        one element (its weight, set by the caller)."""
        stride = self.shard_numel + 1
        flat = torch.zeros(stride * self._size, dtype=self._dtype, device=self._device)
        for p, offset in self._pieces():
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ValueError(
                        f"rank {runtime.rank()}: td.ZeroOptimizer: a parameter of shape "
                        f"{tuple(p.shape)} has a sparse gradient (nn.Embedding(sparse=True)), which "
                        f"the flat reduce-scatter cannot carry. Build it with sparse=False, or use "
                        f"tandem.horovod's hvd.DistributedOptimizer, which averages sparse gradients")
                grad = p.grad.reshape(-1)
                at, end = offset, offset + p.numel()
                while at < end:  # a parameter may span shards (flat): one copy per shard
                    r, within = divmod(at, self.shard_numel)
                    take = min(end - at, self.shard_numel - within)
                    flat[r * stride + within : r * stride + within + take].copy_(
                        grad[at - offset : at - offset + take])
                    at += take
        return flat

    def _mine(self, offset: int, n: int) -> tuple[int, int] | None:
        """The part [a, b) of a parameter at `offset` (n elements) inside this rank's shard."""
        a, b = max(offset, self._lo), min(offset + n, self._hi)
        return (a, b) if a < b else None

    def _read_shard(self) -> None:
        with torch.no_grad():
            for p, offset in self._pieces():
                part = self._mine(offset, p.numel())
                if part is not None:
                    a, b = part
                    self._shard[a - self._lo : b - self._lo].copy_(
                        p.detach().reshape(-1)[a - offset : b - offset])

    def _write_parameters(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, offset in self._pieces():
                p.copy_(flat[offset : offset + p.numel()].view(p.shape))

    def _communicate(self, kind: str, output: torch.Tensor, input: torch.Tensor) -> None:
        """Reduce-scatter (sum) or all-gather straight on the backend: layouts agreed at init."""
        if self._size == 1:
            output.copy_(input)
            return
        if kind == "reducescatter":
            work, out, _sent = direct.reducescatter_into(output, input, "sum", self.group)
        else:
            work, out, _sent = direct.allgather_into(output, input, self.group)
        start = time.perf_counter()
        work.wait(runtime.state().timeout)
        steps.add_comm(time.perf_counter() - start)
        if out is not output:
            output.copy_(out)

    # -- memory and checkpoints --------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (about 1/size of the unsharded state)."""
        return sum(
            v.numel() * v.element_size()
            for state in self.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state dict, as the unsharded optimizer would return it.

        Collective: every rank must call it (each contributes its shard); every rank gets it.
        """
        if self.sharding == "whole":
            return self._whole_state_dict()
        inner = self.optimizer.state_dict()
        # What each group's state holds on this rank: per-element tensors (gathered below)
        # and everything else (scalars such as Adam's step, equal on every rank).
        summary = []
        for g, (view, _) in enumerate(self._views):
            state = inner["state"].get(g, {})
            elementwise = {k: str(v.dtype) for k, v in state.items() if per_element(k, v, view)}
            others = {k: v for k, v in state.items() if k not in elementwise}
            summary.append((elementwise, others))
        everyone = collectives.allgather_object(summary, group=self.group)
        full_state: dict[int, dict[str, Any]] = {}
        index = 0
        for g, (params, offsets) in enumerate(zip(self._params, self._offsets, strict=True)):
            keys: dict[str, str] = {}
            scalars: dict[str, Any] = {}
            for elementwise, others in (ranks_summary[g] for ranks_summary in everyone):
                keys.update(elementwise)
                for k, v in others.items():
                    scalars.setdefault(k, v)
            gathered = {k: self._gather_state(g, k, getattr(torch, dtype.replace("torch.", "")))
                        for k, dtype in sorted(keys.items())}
            for p, offset in zip(params, offsets, strict=True):
                if keys or scalars:
                    entry = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
                    for k, full in gathered.items():
                        entry[k] = full[offset : offset + p.numel()].view(p.shape).clone()
                    full_state[index] = entry
                index += 1
        groups = []
        index = 0
        for group_dict, params in zip(inner["param_groups"], self._params, strict=True):
            groups.append({**group_dict, "params": list(range(index, index + len(params)))})
            index += len(params)
        return {"state": full_state, "param_groups": groups}

    def owned_state(self) -> dict[int, dict[str, Any]]:
        """Whole sharding: the state of each parameter this rank steps, by its index in the
        optimizer's order (copies, on the CPU)."""
        out = {}
        for index, (view, _) in zip(self.owned, self._views, strict=True):
            entry = self.optimizer.state.get(view)
            if entry:
                out[index] = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v)
                              else copy.deepcopy(v) for k, v in entry.items()}
        return out

    def _whole_state_dict(self) -> dict[str, Any]:
        full_state: dict[int, dict[str, Any]] = {}
        for part in collectives.allgather_object(self.owned_state(), group=self.group):
            full_state.update(part)
        state = {i: {k: v.to(self._device) if torch.is_tensor(v) and v.dim() else v
                     for k, v in full_state[i].items()} for i in sorted(full_state)}
        groups, index = [], 0
        for group_dict, params in zip(self.optimizer.state_dict()["param_groups"], self._params,
                                      strict=True):
            groups.append({**group_dict, "params": list(range(index, index + len(params)))})
            index += len(params)
        return {"state": state, "param_groups": groups}

    def _gather_state(self, g: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The per-element state `key` of group g over the whole flat space (zeros elsewhere)."""
        view, _ = self._views[g]
        mine = torch.zeros(self.shard_numel, dtype=dtype, device=self._device)
        value = self.optimizer.state.get(view, {}).get(key)
        if value is not None and view.numel():
            a = self._view_starts[g]
            mine[a : a + view.numel()].copy_(value)
        full = torch.empty(self.shard_numel * self._size, dtype=dtype, device=self._device)
        self._communicate("allgather", full, mine)
        return full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state dict (from `state_dict()` or an unsharded optimizer)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._params) or any(
            len(s["params"]) != len(p) for s, p in zip(saved_groups, self._params, strict=False)
        ):
            raise ValueError(
                f"the state dict has param groups of sizes {[len(s['params']) for s in saved_groups]}, "
                f"this optimizer has {[len(p) for p in self._params]}: it belongs to another model"
            )
        saved_state = state_dict["state"]
        if self.sharding == "whole":
            self._load_whole(saved_groups, saved_state)
            return
        inner_state: dict[int, dict[str, Any]] = {}
        for g, (saved, params, offsets) in enumerate(
            zip(saved_groups, self._params, self._offsets, strict=True)
        ):
            view, _ = self._views[g]
            entries = [(p, offset, saved_state.get(index, saved_state.get(str(index))))
                       for p, offset, index in zip(params, offsets, saved["params"], strict=True)]
            if not any(entry for _, _, entry in entries):
                continue
            state: dict[str, Any] = {}
            elementwise: set[str] = set()
            for p, _, entry in entries:
                for k, v in (entry or {}).items():
                    if per_element(k, v, p):
                        elementwise.add(k)
                    else:
                        state.setdefault(k, v)
            for k in elementwise:
                pieces = []
                for p, offset, entry in entries:
                    part = self._mine(offset, p.numel())
                    if part is None:
                        continue
                    a, b = part
                    value = (entry or {}).get(k)
                    if value is None:
                        pieces.append(torch.zeros(b - a, dtype=self._dtype, device=self._device))
                    else:
                        pieces.append(value.detach().reshape(-1)[a - offset : b - offset])
                dtype = next(e[k].dtype for _, _, e in entries if e and k in e)
                state[k] = (torch.cat([x.to(dtype) for x in pieces]) if pieces
                            else torch.zeros(0, dtype=dtype, device=self._device))
            inner_state[g] = state
        inner_groups = [{**saved, "params": [g]} for g, saved in enumerate(saved_groups)]
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def _load_whole(self, saved_groups: list[dict[str, Any]], saved_state: dict) -> None:
        """Whole sharding: keep the state of the parameters this rank steps."""
        inner_state: dict[int, dict[str, Any]] = {}
        inner_groups = []
        index = n = 0
        for saved, params in zip(saved_groups, self._params, strict=True):
            ids = []
            for key in saved["params"][: len(params)]:
                if self.owners[index] == self._rank:
                    entry = saved_state.get(key, saved_state.get(str(key)))
                    if entry:
                        inner_state[n] = entry
                    ids.append(n)
                    n += 1
                index += 1
            inner_groups.append({**saved, "params": ids})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    # -- the layout protocol (checkpoints) ----------------------------------------------------
    def state_placements(self, placements: dict[int, tuple[Placement, ...]]
                         ) -> list[tuple[torch.Tensor, tuple[Placement, ...]]]:
        """What each tensor the wrapped optimizer steps holds of the one-process tensors, in
        its order, given the model parameters' placements (by id): per-element state follows.

        Flat: one view per param group, a range of the flat space in which the group's
        parameters lie end to end. Whole: one view per parameter this rank owns, all of it
        (the other ranks hold nothing of it, as a pipeline stage's parameters)."""
        names: list[list[str]] = []
        for params in self._params:
            names.append([])
            for p in params:
                piece = placements.get(id(p))
                if piece is None or len(piece) != 1 or piece[0].chunks[0].numel != p.numel():
                    raise ValueError("ZeroOptimizer over parameters that are themselves split "
                                     "(a shard or a tensor-parallel slice) cannot be "
                                     "checkpointed")
                names[-1].append(piece[0].name)
        if self.sharding == "whole":
            flat_names = [n for group in names for n in group]
            return [(view, (whole(flat_names[i], view),))
                    for i, (view, _) in zip(self.owned, self._views, strict=True)]
        out = []
        for index, ((view, _), params, (start, _)) in enumerate(
                zip(self._views, self._params, self._group_ranges, strict=True)):
            lo = self.space.start + self._view_starts[index]
            out.append((view, self.space.placements(
                names[index], [tuple(p.shape) for p in params], lo, lo + view.numel(),
                base=start)))
        return out


def balance(sizes: list[int], size: int) -> tuple[list[int], list[int]]:
    """(the owner rank of each tensor, each rank's load): the largest first, each onto the
    least loaded rank (the lowest on a tie). Deterministic: every rank computes the same."""
    owners, loads = [0] * len(sizes), [0] * size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += sizes[i]
    return owners, loads


class ZeroOptimizerOwner(WrapperOwner):
    """What model-wide calls ask of a ZeroOptimizer (`parallel/layout/owner.py`): its state
    in flat shards (or whole parameters) over the group, cut again at each change of world."""

    kind = "ZeroOptimizer"

    def describe(self) -> str:
        return (f"{super().describe()} over {group_size(self.obj.group)} ranks "
                f"({self.obj.sharding} sharding)")

    def state_placements(self, placements: dict[int, tuple[Placement, ...]]
                         ) -> list[tuple[torch.Tensor, tuple[Placement, ...]]]:
        return self.obj.state_placements(placements)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.obj.clip_grad_norm_(max_norm, norm_type)

    def rejoin(self) -> None:
        """A new world (td.elastic): shards for its size; td.elastic.State then fills this
        rank's new shard from the boxes of the committed state that the ranks held (the
        checkpoint's path, `parallel/layout/state_pieces.py`), as `state_placements` says."""
        self.obj._partition()

    def sharded_over_world(self) -> bool:
        return True


register(ZeroOptimizer, ZeroOptimizerOwner)
