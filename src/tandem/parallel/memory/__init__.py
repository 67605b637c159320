"""How many bytes each rank holds for a model under each of tandem's layouts, before running it.

    est = td.memory.estimate_memory(model, world_size=8, layout="fully_shard", units=model.blocks)
    print(est)                                  # parameters, gradients, optimizer, peak
    print(td.memory.compare_memory(model, world_size=8, units=model.blocks))   # every layout, one table

The model may live on the meta device (`with torch.device("meta"): model = Net()`): only
shapes and dtypes are read, so a model too large for this machine can be estimated. A model
already wrapped by `td.fully_shard` brings its units; otherwise `units=` names the modules that
would each be one (the root is always one more, holding what they leave).

Per rank, with P parameters of b bytes (fp32: 4), N ranks and Adam (two moments of b bytes):

| layout | parameters | gradients | optimizer | buffers | during a step |
|---|---|---|---|---|---|
| ddp | bP | bP | 2bP | - | - (gradients are the bucket buffers) |
| zero | bP | bP | 2bP/N | 2bP/N (the shard and its gradient) | bP (the flat gradient in step()) |
| fully_shard | bP/N | bP/N | 2bP/N | - | gathered units + gradients in flight |
| pipeline | b·P_stage | b·P_stage | 2b·P_stage | - | (activations, not counted) |
| tp | b·P_split/N + b·P_rest | same | twice that | - | (activations, not counted) |

fp32 with Adam gives the README's 16P (ddp), 8P + 8P/N (zero's model states) and 16P/N
(fully_shard). Shards are padded to a multiple of N as tandem pads them. fully_shard's step
adds what `parallel/fully_shard/unit.py` keeps alive at once: the root (gathered from its
forward to the end of its backward), the running unit and the one prefetched beside it, and
the padded fp32 gradient of each unit whose reduce-scatter is still in flight (at most two:
`fully_shard/reduction.py` waits for the oldest before a third). Activations, the input
batch and allocator slack are not counted: they depend on the batch, not the layout.
`benchmarks/sharding.py` measures the same quantities in real processes and prints measured /
estimated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tandem.comm.groups import group_size
from tandem.parallel.layout.owner import owner_of
from tandem.parallel.memory import layouts as formulas
from tandem.parallel.memory import sharded
from tandem.parallel.memory.layouts import OPTIMIZERS
from tandem.parallel.memory.report import MemoryComparison, MemoryEstimate

__all__ = ["LAYOUTS", "OPTIMIZERS", "MemoryComparison", "MemoryEstimate", "compare_memory",
           "estimate_memory"]

LAYOUTS = {
    "ddp": "td.DistributedDataParallel / td.DistributedOptimizer / td.LocalSGD: a replica per rank",
    "zero": "td.ZeroOptimizer: optimizer state sharded",
    "fully_shard": "td.fully_shard: parameters, gradients and optimizer state sharded",
    "pipeline": "td.Pipeline over the N ranks: each rank one stage of an nn.Sequential",
    "tp": "td.parallelize over the N ranks: the layers of plan= split",
}
OFFLOADS = (None, "cpu")


def estimate_memory(model: nn.Module, *, world_size: int | None = None, layout: str | None = None,
                    optimizer: str | Any = "adam",
                    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                    offload: str | None = None, units: Iterable[nn.Module | str] | None = None,
                    balance: str | Sequence[int] | None = None,
                    plan: Mapping[str, str] | None = None) -> MemoryEstimate:
    """Estimate the bytes per rank of `model` under `layout` over `world_size` ranks.

    The model and the optimizer may be the objects you train: their owners
    (`parallel/layout/owner.py`) then say what the names would: `layout` (a `td.fully_shard`
    model: "fully_shard"; a `td.ZeroOptimizer`: "zero"; a plain or data-parallel one: "ddp"),
    `optimizer` (torch's Adam, AdamW or SGD under any of tandem's wrappers) and `world_size`
    (the ranks of the split's group, in a running job).

        est = td.memory.estimate_memory(model, optimizer=td.ZeroOptimizer(torch.optim.Adam(...)))

    Args:
        model: the one-process model, on any device (meta included), or one already wrapped
            by `td.fully_shard` (its units are then used).
        world_size: N, the ranks the layout splits over (the pipeline's stages, tp's ranks);
            None: the size of the group the model's or optimizer's split is over (tandem must
            be initialised).
        layout: "ddp", "zero", "fully_shard", "pipeline" or "tp" (see `LAYOUTS`); None: the
            layout the model and optimizer are in.
        optimizer: "adam", "adamw", "sgd" or "sgd-momentum", or the optimizer itself (a torch
            Adam, AdamW or SGD, or one of tandem's wrappers over one).
        param_dtype: fully_shard's compute dtype: the units are gathered in it (default: the
            parameters' own dtype; the shards stay in theirs).
        reduce_dtype: fully_shard's gradient reduce-scatter dtype (default: the parameters').
        offload: "cpu": fully_shard keeps its shards and their optimizer state on the host
            (`host` bytes); the device holds what a step gathers and reduces.
        units: fully_shard's units of an unwrapped model: modules (or their qualified names)
            each to be one unit, e.g. `units=model.blocks`; the root is one more. Default: the
            whole model is one unit.
        balance: the pipeline's split, as `td.Pipeline` takes it (None: even layer counts;
            "params"; a list of layer counts).
        plan: tp's plan, as `td.parallelize` takes it ({"mlp.0": "colwise", ...}).

    Returns:
        A `MemoryEstimate`; `print()` it for a table. Nothing is allocated or communicated.

    Raises:
        ValueError: a `world_size` below 1, an unknown layout, optimizer or offload, a dtype
            that is not a floating torch dtype, an option given to a layout it does not apply
            to (`balance` outside "pipeline", `plan` outside "tp", the fully_shard options
            elsewhere), or a model already wrapped by td.fully_shard estimated as "pipeline" or
            "tp", or given `units=`; each message says the fix.
    """
    layout, world_size = _from_owners(model, optimizer, layout, world_size)
    optimizer = _optimizer_name(optimizer)
    _check_arguments(world_size, layout, optimizer, offload)
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{name}={dtype!r}: give a floating torch dtype, e.g. torch.bfloat16")
    if layout != "fully_shard":
        given = [name for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                                          ("offload", offload), ("units", units)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to layout='fully_shard' only, not "
                             f"layout={layout!r}: leave them out, or estimate 'fully_shard'")
    if layout != "pipeline" and balance is not None:
        raise ValueError(f"balance applies to layout='pipeline' only, not layout={layout!r}")
    if layout != "tp" and plan is not None:
        raise ValueError(f"plan applies to layout='tp' only, not layout={layout!r}")
    wrapped = sharded.wrapped_units(model)
    if wrapped is not None and layout in ("pipeline", "tp"):
        raise ValueError(f"this model is already wrapped by td.fully_shard; estimate layout="
                         f"{layout!r} on the unwrapped model (build it on the meta device)")
    if wrapped is not None and units is not None:
        raise ValueError("this model is already wrapped by td.fully_shard, which fixed its units: "
                         "leave out units=, or pass the unwrapped model")
    counted = _tensors(model, wrapped)
    base = {"layout": layout, "world_size": world_size, "optimizer": optimizer,
            "parameters": sum(n for n, _ in counted)}
    n = world_size
    if layout == "ddp":
        return MemoryEstimate(**base, **formulas.replicated(counted, optimizer))
    if layout == "zero":
        return formulas.zero(base, counted, n, optimizer)
    if layout == "fully_shard":
        found = wrapped if wrapped is not None else sharded.planned_units(model, units)
        return sharded.fully_shard(base, found, n, optimizer, param_dtype, reduce_dtype, offload,
                            one_unit=wrapped is None and units is None)
    if layout == "pipeline":
        return formulas.pipeline(base, model, n, optimizer, balance)
    return formulas.tensor_parallel(base, model, n, optimizer, plan)


def compare_memory(model: nn.Module, *, world_size: int, optimizer: str = "adam",
                   layouts: Sequence[str] | None = None, **options) -> MemoryComparison:
    """`estimate_memory` for several layouts (default: every one the model allows), one table.

    Options go to the layouts they apply to: `units`, `param_dtype`, `reduce_dtype`,
    `offload` to fully_shard, `balance` to pipeline, `plan` to tp. Without `plan` tp is left
    out; pipeline is left out of the default for a model that is not an nn.Sequential.

    Args:
        model: the one-process model, on any device (meta included).
        world_size: N, the ranks each layout splits over.
        optimizer: "adam", "adamw", "sgd" or "sgd-momentum".
        layouts: the layouts to estimate (None: every one the model allows).
        **options: `units`, `param_dtype`, `reduce_dtype`, `offload`, `balance`, `plan`, as for
            `estimate_memory`; each goes to the layouts it applies to.

    Returns:
        A `MemoryComparison`, one `MemoryEstimate` per layout; `print()` it for a table.

    Raises:
        TypeError: an unknown option.
        ValueError: a `world_size` below 1, an unknown layout, optimizer or offload, or an
            option `estimate_memory` refuses.
    """
    optimizer = _optimizer_name(optimizer)
    _check_arguments(world_size, "ddp", optimizer, options.get("offload"))
    takes = {"fully_shard": ("units", "param_dtype", "reduce_dtype", "offload"),
             "pipeline": ("balance",), "tp": ("plan",)}
    unknown = set(options) - {k for keys in takes.values() for k in keys}
    if unknown:
        raise TypeError(f"compare_memory got unknown option(s) {sorted(unknown)}; it takes "
                        f"{sorted(k for keys in takes.values() for k in keys)}")
    if layouts is None:
        layouts = ["ddp", "zero", "fully_shard"]
        if (isinstance(model, nn.Sequential) and sharded.wrapped_units(model) is None
                and len(model) >= world_size):  # a stage needs a layer
            layouts.append("pipeline")
        if options.get("plan") is not None:
            layouts.append("tp")
    out = []
    for layout in layouts:
        mine = {k: v for k, v in options.items() if k in takes.get(layout, ())}
        out.append(estimate_memory(model, world_size=world_size, layout=layout,
                                   optimizer=optimizer, **mine))
    return MemoryComparison(out)


# -- what the model's and optimizer's owners say --------------------------------------------------
def _optimizer_name(optimizer: str | Any) -> str:
    """The estimate's name of `optimizer`: a name as given, else its owner's torch optimizer."""
    if isinstance(optimizer, str):
        return optimizer
    owner = owner_of(optimizer)
    inner = owner.optimizer()
    if inner is None:
        raise TypeError(f"optimizer= takes a name ({', '.join(map(repr, OPTIMIZERS))}) or an "
                        f"optimizer, got {owner.describe()}")
    if isinstance(inner, torch.optim.SGD):
        return "sgd-momentum" if any(g.get("momentum", 0) for g in inner.param_groups) else "sgd"
    names = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}
    if type(inner) in names:
        return names[type(inner)]
    raise ValueError(f"the estimate knows the state of Adam, AdamW and SGD, not "
                     f"{owner.describe()}: pass optimizer= the name of the one whose state is "
                     f"closest ({', '.join(map(repr, OPTIMIZERS))})")


def _from_owners(model: nn.Module, optimizer: str | Any, layout: str | None,
                 world_size: int | None) -> tuple[str, int]:
    """`layout` and `world_size`, those not given from what the owners of `model` and
    `optimizer` answer."""
    if layout is not None and world_size is not None:
        return layout, world_size
    model_owner = owner_of(model)
    kinds = model_owner.split_kinds()
    optimizer_owner = None if isinstance(optimizer, str) else owner_of(optimizer)
    splits_model = [k for k in kinds if k != "fully_shard"]
    if layout is None and splits_model:
        raise ValueError(f"{model_owner.describe()} is split ({', '.join(sorted(splits_model))}): "
                         f"each rank holds its part, and the estimate needs the whole model. "
                         f"Estimate the unsplit model (built on the meta device) with "
                         f"layout='pipeline' or layout='tp', plan=...")
    if layout is None:
        if "fully_shard" in kinds:
            layout = "fully_shard"
        elif optimizer_owner is not None and optimizer_owner.sharded_over_world():
            layout = "zero"
        else:
            layout = "ddp"
    if world_size is None:
        group = optimizer_owner.group if optimizer_owner is not None else None
        try:
            world_size = group_size(group)
        except RuntimeError as error:
            raise ValueError(f"world_size=None is the size of the job, and tandem is not "
                             f"initialised here ({error}): give world_size=N") from error
    return layout, world_size


# -- arguments and the model's tensors --------------------------------------------------------
def _check_arguments(world_size: int, layout: str, optimizer: str, offload: str | None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: give the number of ranks, an int >= 1")
    if layout not in LAYOUTS:
        choices = "; ".join(f"{name!r} ({what})" for name, what in LAYOUTS.items())
        raise ValueError(f"unknown layout {layout!r}: choose one of {choices}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of "
                         f"{', '.join(map(repr, OPTIMIZERS))} (sgd-momentum: SGD with momentum > 0)")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r}: give None or 'cpu'")


def _tensors(model: nn.Module, wrapped: list[sharded.Unit] | None) -> list[tuple[int, int]]:
    """(numel, element size) of every parameter of the unsplit model, each tensor once."""
    from tandem.parallel.layout import splits

    if wrapped is None:
        return [(p.numel(), p.element_size()) for p in model.parameters()]
    # A unit's flat shard stands for its parameters; what no unit owns is a plain parameter.
    plain = [(p.numel(), p.element_size()) for p in model.parameters()
             if splits.kind_of(p) != splits.FULLY_SHARD]
    return [(u.numel, u.dtype.itemsize) for u in wrapped] + plain
