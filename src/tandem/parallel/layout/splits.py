"""Which tensors are split across ranks, how, and over which group: the registry every model-wide
call asks (instead of markers set on the tensors).

    splits.mark(shard, "fully_shard", group)      # fully_shard: a flat shard of a unit
    splits.mark(weight, "tensor parallel", group) # a tensor-parallel slice
    splits.mark(weight, "branch", group)          # a td.tensor.Branches branch: whole, on one rank
    splits.mark(old, "replaced")                  # a parameter fully_shard took out of the model

`td.clip_grad_norm_` reduces norms over the groups of split gradients, `broadcast_parameters`
leaves shards alone and refuses to copy one rank's tensor-parallel slices onto the others,
`DistributedOptimizer` refuses to average different slices, and an optimizer still holding
parameters that fully_shard replaced is refused at its first step. Weak references: a tensor
that goes away leaves the registry with it.

From the first entry on, every torch optimizer's step passes tandem's one pre-step and one
post-step hook (`_watch_optimizers`): refusals at an optimizer's first step, the steps recorded
for `tandem scale`, and the steps counted for the per-operation checks
(`parallel/operation_check.py`), each decided once per optimizer.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from tandem import runtime
from tandem.comm.groups import Group, group_ranks
from tandem.diagnostics import steps
from tandem.parallel.layout.elementwise import refuse_unless_elementwise, refuse_unless_per_tensor

FULLY_SHARD = "fully_shard"
TENSOR_PARALLEL = "tensor parallel"
PIPELINE = "pipeline"  # a stage's own parameters; the group is the pipeline's
# A td.tensor.Branches branch's tensor: whole, held by one rank of the group (the others hold
# other branches). Its optimizer may be any: each rank steps whole tensors, as one process does.
BRANCH = "branch"
# The gradient of a BRANCH tensor when the group's ranks hold different numbers of branch
# tensors: never registered, only its gradient says so, to torch's norms (`split_grads`), which
# cannot pair the ranks' tensors then and refuse with the fix.
BRANCH_UNPAIRED = "branch (unpaired)"
# The kinds whose collectives run inside forward and backward (td.join cannot stand in for
# them), and whose plain torch optimizer records its steps.
MODEL_SPLITS = frozenset({FULLY_SHARD, TENSOR_PARALLEL, BRANCH, PIPELINE})
# The kinds whose ranks hold different tensors under one name: averaging or broadcasting over
# a group that reaches several of them mixes them.
NOT_REPLICAS = frozenset({TENSOR_PARALLEL, BRANCH})
REPLACED = "replaced"
# A ZeroOptimizer's parameter: replicated, but its .grad is this rank's own until step()
# averages it. Never registered (the parameter is whole); only its gradient says so, to
# torch's norms (`split_grads`).
ZERO = "ZeroOptimizer"


class Split(NamedTuple):
    kind: str
    group: Group | None


_REGISTRY = WeakIdKeyDictionary()


def mark(tensor: torch.Tensor, kind: str, group: Group | None = None) -> None:
    _REGISTRY[tensor] = Split(kind, group)
    _changed()  # an optimizer over it is checked, and its steps recorded, from its next step
    _watch_optimizers()


_watching = False


def _watch_optimizers() -> None:
    """From the first split tensor (or checked model, or data-parallel parameter) on, torch
    optimizers are watched by one pre-step and one post-step hook for the process. At an
    optimizer's first step, and again when what it holds or what tandem knows about it changed
    (`_plan`):

    - it is refused if it holds a parameter fully_shard took out of the model (it would step
      tensors the model no longer uses; the loss would print as usual while nothing trains),
      if it steps shards or slices and does not update each element on its own (`elementwise`:
      Adafactor, Muon or LAMB would run another algorithm; whole tensors, a pipeline stage's or
      a Branches branch's, take any optimizer that steps each tensor on its own), or if it
      holds no fully_shard shard and none of its parameters has a gradient while a fully_shard
      backward just graded shards (another model's parameters: its steps would train nothing);
    - its plan is kept: whether it holds shards (its step clears `graded`), whether it records
      its steps for `tandem scale` and `MetricLogger(timing=True)` (a plain torch optimizer over
      split parameters or a `DistributedDataParallel` model's; DistributedOptimizer, LocalSGD and
      ZeroOptimizer record their own), and the per-operation checks whose parameters it steps
      (`count_steps`: their `steps` counts it, so a rank that skipped a step is named).

    Per step: one dictionary look-up in each hook, then what the plan says."""
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _watching = True


class _Plan(NamedTuple):
    """What the hooks do for one optimizer, decided once (see `_watch_optimizers`)."""

    generation: int  # `_generation` when made: a later one makes it again
    groups: int  # its param_groups then: add_param_group makes it again
    holds_shards: bool
    accounts: bool
    counted: list  # weak references to the checks whose `steps` it advances


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Plan
_generation = 0  # bumped when a plan may have changed (a tensor marked, a check counted, ...)
_accounted: weakref.WeakSet = weakref.WeakSet()  # optimizers whose wrapper records their steps
_counted: weakref.WeakSet = weakref.WeakSet()  # checks (`param_ids`, `steps`) counting steps
_graded: list = [None]  # a weak reference to a shard graded since an optimizer over shards stepped


def _changed() -> None:
    global _generation
    _generation += 1


def accounted_elsewhere(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` is wrapped by a tandem class that records its steps itself."""
    _accounted.add(optimizer)
    _plans.pop(optimizer, None)


def count_steps(check) -> None:
    """Every step of an optimizer over any of `check.param_ids` adds one to `check.steps`."""
    _counted.add(check)
    _changed()
    _watch_optimizers()


def graded(shard: torch.Tensor) -> None:
    """A fully_shard backward wrote `shard`'s gradient."""
    _graded[0] = weakref.ref(shard)


def _before_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    plan = _plans.get(optimizer)
    if plan is None or plan.generation != _generation or plan.groups != len(optimizer.param_groups):
        plan = _plan(optimizer)
    if plan.holds_shards:
        _graded[0] = None


def _after_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    plan = _plans.get(optimizer)
    if plan is None:
        return
    for ref in plan.counted:
        check = ref()
        if check is not None:
            check.steps += 1
    if plan.accounts:
        steps.step_done()


def _plan(optimizer: torch.optim.Optimizer) -> _Plan:
    """Refuse `optimizer` (see `_watch_optimizers`) or keep what its steps must do."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _refuse(optimizer, params)
    holds_shards = _holds_shards(optimizer, params)
    accounts = optimizer not in _accounted and any(
        kind_of(p) in MODEL_SPLITS or reducer_of(p) is not None for p in params)
    ids = {id(p) for p in params}
    counted = [weakref.ref(c) for c in _counted if c.param_ids & ids]
    plan = _plans[optimizer] = _Plan(_generation, len(optimizer.param_groups), holds_shards,
                                     accounts, counted)
    return plan


def _refuse(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    stale = [i for i, p in enumerate(params) if kind_of(p) == REPLACED]
    if stale:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(stale)} of {len(params)} parameters that "
            f"td.fully_shard replaced by its shards (parameter #{stale[0]} first): stepping them "
            f"would train nothing. Build the optimizer after fully_shard: "
            f"opt = torch.optim.{type(optimizer).__name__}(model.parameters(), ...)")
    kinds = {kind_of(p) for p in params}
    if FULLY_SHARD in kinds:  # flat 1-D shards of each parameter
        refuse_unless_elementwise(optimizer, "td.fully_shard", "Use td.DistributedDataParallel "
                                  "(whole parameters on every rank), or an element-wise "
                                  "optimizer such as AdamW")
    if TENSOR_PARALLEL in kinds:  # slices of a matrix: its rows or its columns
        refuse_unless_elementwise(optimizer, "tensor parallelism", "Keep the tensor-parallel "
                                  "layers' parameters with an element-wise optimizer such as "
                                  "AdamW, or train the model data-parallel")
    # Whole one-process tensors, each held by one rank (a stage's, a branch's): any optimizer
    # that updates each tensor on its own steps them as one process does
    if PIPELINE in kinds:
        refuse_unless_per_tensor(optimizer, "td.Pipeline", "The other stages' parameters are on "
                                 "other ranks: use an optimizer that steps each tensor on its "
                                 "own (AdamW, Adafactor, Muon, ...), or train the whole model "
                                 "on every rank with td.DistributedDataParallel")
    if BRANCH in kinds:
        refuse_unless_per_tensor(optimizer, "td.tensor.Branches", "The other branches' "
                                 "parameters are on other ranks: use an optimizer that steps "
                                 "each tensor on its own (AdamW, Adafactor, Muon, ...), or "
                                 "train the model with its branches whole on every rank "
                                 "(td.DistributedDataParallel)")


def _holds_shards(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether `optimizer` holds shards; raises when it steps nothing while shards have
    gradients (`optimizer = torch.optim.AdamW(other.parameters())` beside a fully sharded
    model: the shards get gradients that no optimizer reads, the loss stays flat)."""
    shard = _graded[0]() if _graded[0] is not None else None
    if any(p is shard or kind_of(p) == FULLY_SHARD for p in params):
        return True
    if shard is None or shard.grad is None or any(p.grad is not None for p in params):
        return False
    name = type(optimizer).__name__
    where = f"rank {runtime.rank()}: " if runtime.is_initialized() else ""
    raise ValueError(
        f"{where}{name} holds {len(params)} parameters, none of them a td.fully_shard shard and "
        f"none with a gradient, while the fully sharded model's shards just got theirs from "
        f"backward: its steps would train nothing (another model's parameters?). Build the "
        f"optimizer over the sharded model, after td.fully_shard: "
        f"opt = torch.optim.{name}(model.parameters(), ...)")


def split_of(tensor: torch.Tensor) -> Split | None:
    """How `tensor` is split (None: every rank that holds it holds all of it)."""
    return _REGISTRY.get(tensor)


def mixes_slices(tensor: torch.Tensor, group: Group | None) -> bool:
    """Whether `group` holds several different tensor-parallel slices of `tensor`, or several
    Branches branches under its name (averaging or broadcasting over it would mix them)."""
    split = split_of(tensor)
    if split is None or split.kind not in NOT_REPLICAS:
        return False
    return len(set(group_ranks(group)) & set(group_ranks(split.group))) > 1


def refuse_mixing(named: list[tuple[str, torch.Tensor]], group: Group | None, who: str) -> None:
    """Raise when `who` (a wrapper that treats the ranks of `group` as replicas) is given
    tensors that those ranks hold different slices or branches of, naming the first and the
    alternative for its kind."""
    mixed = [(name, split_of(t)) for name, t in named if mixes_slices(t, group)]
    if not mixed:
        return
    name, split = mixed[0]
    ranks = list(group_ranks(group))
    if split.kind == BRANCH:
        raise ValueError(
            f"{who} over ranks {ranks} would treat {name!r} as a replica, but it is a "
            f"td.tensor.Branches branch held whole by one rank of {list(group_ranks(split.group))} "
            f"(the others hold other branches under its name): training another model. Each "
            f"branch's optimizer state already lives on its rank alone: step the model with the "
            f"plain torch optimizer (any, Adafactor and Muon included, gives one process's "
            f"result), or shard over the ranks that hold the same branches, group=mesh.dp_group")
    raise ValueError(
        f"{who} over ranks {ranks} would average different tensor-parallel slices of {name!r}, "
        f"training another model: shard over the ranks that hold the same slices, "
        f"group=mesh.dp_group")


def kind_of(tensor: torch.Tensor) -> str | None:
    split = split_of(tensor)
    return None if split is None else split.kind


# parameter -> weak reference to the reducer that averages its gradient: one reducer per
# parameter, and the pipeline finds the reducers over a stage here.
_REDUCERS = WeakIdKeyDictionary()


def set_reducer(param: torch.Tensor, reducer_ref: weakref.ref) -> None:
    _REDUCERS[param] = reducer_ref
    _changed()
    _watch_optimizers()  # the plain optimizer of a DistributedDataParallel model: its steps count


def reducer_of(param: torch.Tensor):
    """The live reducer that averages `param`'s gradient, if any."""
    ref = _REDUCERS.get(param)
    return ref() if ref is not None else None
