"""Gradients of split parameters that give torch's own norm functions the global answer.

PyTorch's FSDP2 parameters are DTensors, so a script's own
`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` sees the global norm there. tandem's
shards and slices are plain tensors (its engines need no torch process group), so a ported
script would clip every rank by the norm of its own piece: a silent wrong number. Instead, the
gradient of a split parameter is a `SplitGrad`: a plain tensor for every operation (optimizers,
GradScaler, `.add_`) except norms over the whole tensor (`torch.linalg.vector_norm`,
`torch.norm`, `Tensor.norm`, `torch._foreach_norm`), which return the norm of the whole
one-process tensor by reducing over the group that holds its pieces:

- a fully_shard shard: over the unit's group (every rank holds the same units, in order);
- a tensor-parallel slice: over the tensor-parallel group;
- a `Branches` branch (whole on its rank): over the Branches' group, each rank's tensors paired
  in order, so torch's `clip_grad_norm_` sees the whole model's norm when every rank holds as
  many branch tensors. When they hold different numbers, the ranks could not pair their calls
  (a wrong norm on one rank, a wait on another): the norm is refused with the fix,
  `td.clip_grad_norm_(model, max_norm)`, which reduces one partial sum per group (any counts).

A `ZeroOptimizer`'s gradient is this rank's own until its `step()` averages it: its norm is
refused with the fix, `opt.clip_grad_norm_(max_norm)`.

Every rank of that group must call the norm, as every rank calls `clip_grad_norm_` in a data
parallel script. A pipeline stage's gradients cannot be matched tensor by tensor across stages
(each stage holds other tensors): their norm is refused with the fix, `td.clip_grad_norm_(pipe)`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.parallel.layout import splits

_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch._foreach_norm}


class SplitGrad(torch.Tensor):
    """The gradient of a split parameter (see the module docstring)."""

    split: splits.Split

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            return _global_norms(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def as_split_grad(grad: torch.Tensor, split: splits.Split) -> torch.Tensor:
    """`grad` (same storage) as a `SplitGrad` of `split`."""
    if type(grad) is SplitGrad:
        return grad
    out = grad.as_subclass(SplitGrad)
    out.split = split
    return out


def mark_grads(param: torch.Tensor, split: splits.Split | None = None) -> None:
    """From now on, `param`'s gradient (as autograd accumulates it) is a `SplitGrad` (of
    `split`, by default the registry's)."""
    split = split or splits.split_of(param)

    def wrap(p: torch.Tensor) -> None:  # a sparse gradient (SparseAdam's) has no storage to share
        if p.grad is not None and type(p.grad) is not SplitGrad and not p.grad.is_sparse:
            p.grad = as_split_grad(p.grad, split)

    param.register_post_accumulate_grad_hook(wrap)


def _plain(t: Any) -> Any:
    return t.as_subclass(torch.Tensor) if isinstance(t, SplitGrad) else t


def _global_norms(func, args, kwargs):
    if func is torch._foreach_norm:
        tensors, rest = args[0], args[1:]
        order = rest[0] if rest else kwargs.get("ord", 2)
        return [_global_norm(t, order) for t in tensors]
    tensor = args[0]
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    if dims is not None:
        with torch._C.DisableTorchFunctionSubclass():  # a norm along dims stays per piece
            return func(*args, **kwargs)
    return _global_norm(tensor, 2.0 if order in ("fro", None) else order)


def _global_norm(tensor: Any, order: float) -> torch.Tensor:
    from tandem import runtime
    from tandem.comm.collectives import user as collectives

    plain = _plain(tensor)
    split = getattr(tensor, "split", None)
    if split is None or not runtime.is_initialized():
        return torch.linalg.vector_norm(plain, order)
    if split.kind == splits.ZERO:
        raise ValueError(
            "torch's norm of a ZeroOptimizer's gradient sees this rank's own gradient, which "
            "step() averages only later: clip with opt.clip_grad_norm_(max_norm) (or "
            "td.clip_grad_norm_(model, max_norm)), which clips the averaged gradient")
    if split.kind == splits.PIPELINE:
        raise ValueError(
            "torch's norm of a pipeline stage's gradient sees that stage's tensors only, and the "
            "stages hold different tensors: clip a td.Pipeline with td.clip_grad_norm_(pipe, "
            "max_norm), which reduces over its stages")
    if split.kind == splits.BRANCH_UNPAIRED:
        raise ValueError(
            "torch's norm of a td.tensor.Branches branch's gradient: the ranks of the Branches' "
            "group hold different numbers of branch tensors, so their norms cannot be paired "
            "into the whole model's: clip with td.clip_grad_norm_(model, max_norm), which "
            "reduces over the group whatever each rank holds")
    order = float(order)
    if order == math.inf:
        local = torch.linalg.vector_norm(plain.float(), order).reshape(1)
        return collectives.allreduce(local, op="max", group=split.group)[0].to(plain.dtype)
    if order <= 0:
        raise ValueError(f"norm of order {order} over a split gradient: use a positive order or inf")
    local = plain.float().abs().pow(order).sum().reshape(1)
    total = collectives.allreduce(local, op="sum", group=split.group)[0]
    return total.pow(1.0 / order).to(plain.dtype)
