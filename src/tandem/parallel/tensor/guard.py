"""One agreement per forward covers every tensor-parallel collective inside it.

The collectives of tensor-parallel layers go straight to the engine (`comm/collectives/direct.py`), with
no argument check of their own. What keeps a rank that skipped a forward or a backward from
having its messages matched with another operation's is the agreement that each forward and
each backward of the model opens with (`parallel/operation_check.py`): `td.parallelize` sets it up
on the model it converts (`cover`), `Branches` on itself.

A layer built by hand (`ColumnParallelLinear(...)` in a model's `__init__`) has no such model.
So `ensure`, called by each split region, finds the outermost module whose forward is running
the first time a region runs outside a covered forward, and watches it as `parallelize` would:
from its next forward on, that forward opens with one agreement over the layer's group (its
inputs' shapes must match, as for `parallelize`), and its backward with another. Until then (the
rest of that first forward, and its backward) each collective is checked alone, as a
user-facing collective is. With checks off, on a group of one rank or on NCCL (where the
agreement would be a host synchronisation), nothing is agreed and every call is direct.
Compiled, the regions ask `ensure` when the graph runs (`region_ops.tp_checked`), and the
covering module is never the `torch.compile` wrapper but the module it calls.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tandem.comm.collectives import direct
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_ranks
from tandem.parallel import model_check
from tandem.parallel.data_parallel import compile_split
from tandem.parallel.operation_check import OperationCheck, agreeing

_CALL = nn.Module._call_impl.__code__
# module -> {its group's ranks: the hooks that cover it}; modules kept weakly
_watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ensure(group: Group | None) -> bool:
    """Before a split region's collective: True when it must be checked alone (no agreement
    covers it yet), False when it may go straight to the engine."""
    if direct.frame(group) is not None or not agreeing(group):
        return False
    outermost = _outermost_module()
    if outermost is not None and tuple(group_ranks(group)) not in _watched.get(outermost, {}):
        cover(outermost, group, OperationCheck.make(
            "tensor-parallel", type(outermost).__name__, _layout(outermost, group), group,
            outermost.parameters()))
    return True


def cover(module: nn.Module, group: Group | None, check: OperationCheck | None,
          explain=None) -> None:
    """Mark every forward of `module` as covered by an agreement over `group`: `check` (if
    any) opens it, and its backward at the first gradient of its output. Once per group."""
    key = tuple(group_ranks(group))
    known = _watched.setdefault(module, {})
    if key in known:
        return
    hooks = known[key] = _Cover(group, key, check, explain or explain_inputs)
    module.register_forward_pre_hook(hooks.before, with_kwargs=True)
    module.register_forward_hook(hooks.after, always_call=True)
    compile_split.hooks_outside_graph(module)


class _Cover:
    """A covered module's hooks. They act only for the module they were registered on (found
    in `_watched`): a copy of the module (`copy.deepcopy`) carries inert copies of them, and is
    covered anew by its own first forward (`ensure`)."""

    def __init__(self, group: Group | None, key: tuple[int, ...],
                 check: OperationCheck | None, explain) -> None:
        self.group, self.key, self.check, self.explain = group, key, check, explain
        self.open: list[direct.Frame] = []  # the forwards of the module running now

    # Never traced: the agreement communicates, and its per-forward counters would become
    # dynamo guards. On the compiled model itself, torch.compile runs these hooks outside the
    # graph (no break; the regions inside are operators of the graph, `region_ops`); on a
    # module called inside a compiled one, they are one graph break at its entry.
    @torch.compiler.disable
    def before(self, module: nn.Module, args, kwargs) -> None:
        if _watched.get(module, {}).get(self.key) is not self:
            return
        if self.check is not None:
            shapes = str([tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)])
            self.check.forward_starts(shapes, self.explain)
        self.open.append(direct.enter(self.group))

    @torch.compiler.disable
    def after(self, module: nn.Module, _args, output) -> None:
        if _watched.get(module, {}).get(self.key) is not self:
            return
        if self.open:  # (not when an earlier pre-hook raised before `before` ran)
            direct.leave(self.open.pop())
        if self.check is not None and output is not None:
            model_check.expect_backward_of(self.check, output)


def _outermost_module() -> nn.Module | None:
    """The outermost module whose forward is running in this thread (its `__call__`'s frame).
    Not a `torch.compile` wrapper: it calls its module, which is found inside it (and named
    in errors as the user wrote it), and whose hooks run outside the compiled graph too."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and not isinstance(getattr(module, "_orig_mod", None),
                                                                nn.Module):
                found = module
        frame = frame.f_back
    return found


def _layout(module: nn.Module, group: Group | None) -> list[str]:
    lines = [f"tensor-parallel group {list(group_ranks(group))}"]
    lines += [f"{name}: {type(m).__name__}" for name, m in module.named_modules()]
    lines += [f"{name} {tuple(p.shape)}" for name, p in module.named_parameters()]
    return lines


def explain_inputs(ranks: tuple[int, ...], shapes: list) -> str:
    lines = "\n".join(f"  rank {r}: {s}" for r, s in zip(ranks, shapes, strict=True))
    return ("the ranks of a tensor-parallel group called the model with inputs of different "
            f"shapes:\n{lines}\nEvery rank of the group computes the same batch (its layers split "
            "the weights, not the data): give each the same input (split the batch across the "
            "data-parallel group only).")
