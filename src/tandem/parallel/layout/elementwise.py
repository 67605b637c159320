"""Whether an optimizer may step flat shards of a parameter: is its update element-wise?

`td.ZeroOptimizer` and `td.fully_shard` hand the wrapped optimizer flat 1-D pieces of the
parameters. That is exact for an optimizer that updates each element on its own (SGD, Adam,
RMSprop, ...), and a different algorithm for one that looks at a whole tensor: Adafactor
factors its second moment by the rows and columns of a matrix, Muon orthogonalizes a whole
matrix, LAMB and LARS scale by a tensor's norm. Such an optimizer would train silently to
another result, so it is refused with the reason and the alternative.

torch's own optimizers are known. Any other is *probed* once, at construction: a fresh
optimizer of its class, with its hyper-parameters, steps a 4x6 matrix whole and the same
numbers cut into two flat pieces (11 and 13 elements); element-wise means both give the same
numbers. An optimizer the probe cannot run (its constructor wants more than parameters and
hyper-parameters, its step wants a closure) is refused with the flag that settles it:
`optimizer.elementwise = True` (or False) set by the user, who knows.

Whole tensors held by one rank (a pipeline stage's, a `td.tensor.Branches` branch's) take any
optimizer that updates each tensor on its own (`refuse_unless_per_tensor`): only one that
couples tensors (LBFGS) is refused there.

`td.ZeroOptimizer` can do better than refuse: an optimizer that is not element-wise but
updates each tensor on its own (Adafactor, Muon, LAMB) is sharded by *whole parameters*
(`sharding`: "whole"), each stepped by one rank. Only an optimizer that couples tensors (LBFGS's
history over all parameters) is refused there; SparseAdam is refused by ZeroOptimizer itself
(its sparse gradients do not fit the flat reduce-scatter). An unknown one is
probed a second time: two matrices stepped by one optimizer, and each by its own; per-tensor
means both give the same numbers. `elementwise=False` from the user means per-tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_ELEMENTWISE = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
}
_WHY_NOT = {  # torch's optimizers that look at more than one element, and how
    torch.optim.Adafactor: "factors its second moment by the rows and columns of each matrix",
    torch.optim.Muon: "orthogonalizes each whole matrix",
    torch.optim.LBFGS: "keeps a history over all parameters and needs a closure",
    torch.optim.SparseAdam: "steps sparse gradients",
}
# not element-wise, but tensor by tensor (SparseAdam: element-wise, but on sparse gradients,
# which flat shards cannot carry; whole tensors on one rank, a stage's or a branch's, can)
_PER_TENSOR = {torch.optim.Adafactor, torch.optim.Muon, torch.optim.SparseAdam}
_PROBED: dict[tuple[type, str], bool | str] = {}
_PROBED_PER_TENSOR: dict[tuple[type, str], bool | str] = {}


def why_not_elementwise(optimizer: torch.optim.Optimizer) -> str | None:
    """None when `optimizer` may step flat shards; else the reason it may not, in words."""
    flag = getattr(optimizer, "elementwise", None)
    if flag is not None:
        return None if flag else "was marked elementwise=False"
    cls = type(optimizer)
    if cls in _ELEMENTWISE:
        return None
    if cls in _WHY_NOT:
        return _WHY_NOT[cls]
    hyper, key = _hyper(optimizer)
    if key not in _PROBED:
        _PROBED[key] = _probe(cls, hyper)
    verdict = _PROBED[key]
    return None if verdict is True else str(verdict)


def _hyper(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], tuple[type, str]]:
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} \
        if optimizer.param_groups else dict(optimizer.defaults)
    return hyper, (type(optimizer), repr(sorted(hyper.items(), key=lambda kv: kv[0])))


def why_not_per_tensor(optimizer: torch.optim.Optimizer) -> str | None:
    """None when `optimizer` updates each tensor from that tensor alone (element-wise ones
    included), so one rank may step some whole parameters; else the reason, in words."""
    flag = getattr(optimizer, "elementwise", None)
    if flag is not None:  # True: element-wise; False: the user's word for per-tensor
        return None
    cls = type(optimizer)
    if cls in _ELEMENTWISE or cls in _PER_TENSOR:
        return None
    if cls in _WHY_NOT:
        return _WHY_NOT[cls]
    why = why_not_elementwise(optimizer)
    if why is None:
        return None
    if why.startswith("could not be checked"):
        return why
    hyper, key = _hyper(optimizer)
    if key not in _PROBED_PER_TENSOR:
        _PROBED_PER_TENSOR[key] = _probe_per_tensor(cls, hyper)
    verdict = _PROBED_PER_TENSOR[key]
    return None if verdict is True else str(verdict)


def sharding(optimizer: torch.optim.Optimizer, split: str, alternative: str) -> str:
    """How `split` (td.ZeroOptimizer) may shard `optimizer`'s state: "flat" (any cut of the
    flat space: element-wise), "whole" (whole parameters per rank: per-tensor); else raise,
    naming the optimizer, why, `alternative` and the flag."""
    if why_not_elementwise(optimizer) is None:
        return "flat"
    why = why_not_per_tensor(optimizer)
    if why is None:
        return "whole"
    name = type(optimizer).__name__
    raise ValueError(
        f"{name} under {split}: {name} {why}, so no rank can step its own share of the "
        f"parameters (not even whole ones) to the result of one process. {alternative}. If "
        f"{name}'s update does treat each element on its own, say so: "
        f"`optimizer.elementwise = True` before wrapping (or `elementwise=False` when it "
        f"treats each tensor on its own: {split} then gives each rank whole parameters)")


def refuse_unless_elementwise(optimizer: torch.optim.Optimizer, split: str,
                              alternative: str) -> None:
    """Raise when `optimizer` would step `split`'s flat shards to another result than one
    process. `alternative`: what to do instead, in words."""
    _refuse(optimizer, why_not_elementwise(optimizer), split, alternative,
            f"stepping the parts of each parameter that {split} gives each rank would run "
            f"another algorithm than one process (silently other numbers). ",
            "element", "`optimizer.elementwise = True` before wrapping")


def refuse_unless_per_tensor(optimizer: torch.optim.Optimizer, split: str,
                             alternative: str) -> None:
    """Raise when `optimizer` couples its parameters (LBFGS), so that stepping only the whole
    tensors `split` gives this rank would run another algorithm than one process.
    `alternative`: what to do instead, in words."""
    _refuse(optimizer, why_not_per_tensor(optimizer), split, alternative,
            "stepping only the tensors this rank holds would run another algorithm than one "
            "process (silently other numbers). ",
            "tensor", "`optimizer.elementwise = False` before its first step")


def _refuse(optimizer: torch.optim.Optimizer, why: str | None, split: str, alternative: str,
            consequence: str, unit: str, flag: str) -> None:
    """The one refusal of the two above (nothing when `why` is None): why, what it would do,
    what to do instead, and the flag for a user who knows better."""
    if why is None:
        return
    name = type(optimizer).__name__
    raise ValueError(
        f"{name} under {split}: {name} {why}, so {consequence}"
        f"{alternative}. If {name}'s update does treat each {unit} on its own, say so: {flag}")


def _probe(cls: type, hyper: dict[str, Any]) -> bool | str:
    """Step a matrix whole and cut into two flat pieces with fresh optimizers of `cls`:
    True when the numbers agree, else the reason (in words)."""
    hyper = _constructor_arguments(cls, hyper)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=generator)
    whole = start.clone().requires_grad_()
    pieces = [start.flatten()[:11].clone().requires_grad_(),
              start.flatten()[11:].clone().requires_grad_()]
    try:
        one, cut = cls([whole], **hyper), cls(pieces, **hyper)
        for _ in range(3):
            grad = torch.randn(4, 6, generator=generator)
            whole.grad = grad.clone()
            pieces[0].grad, pieces[1].grad = grad.flatten()[:11].clone(), grad.flatten()[11:].clone()
            one.step()
            cut.step()
    except Exception as error:  # any failure means: cannot tell
        return (f"could not be checked for an element-wise update (stepping a probe raised "
                f"{type(error).__name__}: {error})")
    same = torch.equal(whole.detach().flatten(), torch.cat([p.detach() for p in pieces]))
    return True if same else ("updates a tensor as a whole (a probe matrix stepped whole and in "
                              "two flat pieces came out different)")


def _probe_per_tensor(cls: type, hyper: dict[str, Any]) -> bool | str:
    """Step two matrices with one fresh optimizer of `cls` and each with its own: True when
    the numbers agree (each tensor's update depends on that tensor alone), else the reason."""
    hyper = _constructor_arguments(cls, hyper)
    generator = torch.Generator().manual_seed(1)
    starts = [torch.randn(4, 6, generator=generator), torch.randn(3, 5, generator=generator)]
    together = [t.clone().requires_grad_() for t in starts]
    alone = [t.clone().requires_grad_() for t in starts]
    try:
        one = cls(together, **hyper)
        each = [cls([p], **hyper) for p in alone]
        for _ in range(3):
            grads = [torch.randn(t.shape, generator=generator) for t in starts]
            for p, q, g in zip(together, alone, grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            one.step()
            for optimizer in each:
                optimizer.step()
    except Exception as error:  # any failure means: cannot tell
        return (f"could not be checked for a per-tensor update (stepping a probe raised "
                f"{type(error).__name__}: {error})")
    same = all(torch.equal(p.detach(), q.detach()) for p, q in zip(together, alone, strict=True))
    return True if same else ("couples its parameters (two probe matrices stepped by one "
                              "optimizer and each by its own came out different)")


def _constructor_arguments(cls: type, hyper: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters `cls(...)` takes: a param group may hold keys its constructor does
    not (torch's AdamW keeps Adam's `decoupled_weight_decay`)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return hyper
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return hyper
    return {k: v for k, v in hyper.items() if k in parameters}
