"""How many bytes each rank holds for a model under each of tandem's layouts, before running it.

    est = td.estimate_memory(model, world_size=8, layout="fully_shard", units=model.blocks)
    print(est)                                  # parameters, gradients, optimizer, peak
    print(td.compare_memory(model, world_size=8, units=model.blocks))   # every layout, one table

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
the padded fp32 gradient of every unit whose reduce-scatter is still in flight (they are
waited for at the end of backward). Activations, the input batch and allocator slack are not
counted: they depend on the batch, not the layout. `benchmarks/sharding.py` measures the same
quantities in real processes and prints measured / estimated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

LAYOUTS = {
    "ddp": "td.DistributedDataParallel / td.DistributedOptimizer / td.LocalSGD: a replica per rank",
    "zero": "td.ZeroOptimizer: optimizer state sharded",
    "fully_shard": "td.fully_shard: parameters, gradients and optimizer state sharded",
    "pipeline": "td.Pipeline over the N ranks: each rank one stage of an nn.Sequential",
    "tp": "td.parallelize over the N ranks: the layers of plan= split",
}
#: Per-element state tensors each optimizer keeps (each of the parameter's dtype), and whether
#: it keeps a scalar `step` tensor per parameter (4 bytes: torch's Adam does).
OPTIMIZERS = {"adam": (2, True), "adamw": (2, True), "sgd": (0, False), "sgd-momentum": (1, False)}
OFFLOADS = (None, "cpu")
MiB = 2**20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds (the largest rank, when ranks differ). Sizes are in bytes."""

    layout: str
    world_size: int
    optimizer: str
    parameters: int  # P: the model's parameter count, unsplit
    params: int
    grads: int
    optimizer_state: int
    buffers: int = 0  # the wrapper's own, kept between steps
    transient: int = 0  # the most held at once during a step beyond the above
    offload: str | None = None  # "cpu": params, grads and optimizer state live on the host
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def states(self) -> int:
        """Parameters, gradients and optimizer state (the ZeRO paper's "model states")."""
        return self.params + self.grads + self.optimizer_state

    @property
    def host(self) -> int:
        """Bytes kept in host memory instead of the device (offload="cpu")."""
        return self.states if self.offload else 0

    @property
    def total(self) -> int:
        """Device bytes kept between steps."""
        return self.states + self.buffers - self.host

    @property
    def peak(self) -> int:
        """Device bytes at the busiest moment of a step (activations not counted)."""
        return self.total + self.transient

    def __str__(self) -> str:
        where = f", offload={self.offload!r}" if self.offload else ""
        lines = [f"{self.layout} over {self.world_size} rank(s), {self.optimizer}, "
                 f"{self.parameters / 1e6:.2f} M parameters{where}: MiB per rank"]
        rows = [("parameters", self.params), ("gradients", self.grads),
                ("optimizer state", self.optimizer_state), ("buffers", self.buffers),
                ("between steps", self.total), ("during a step", self.transient),
                ("peak", self.peak)]
        if self.offload:
            rows.append(("on the host", self.host))
        lines += [f"  {name:<16}{value / MiB:>10.2f}" for name, value in rows]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class MemoryComparison(tuple):
    """Several `MemoryEstimate`s, printed as one table."""

    def __str__(self) -> str:
        if not self:
            return "(no layouts)"
        first = self[0]
        head = (f"{first.parameters / 1e6:.2f} M parameters, {first.optimizer}, "
                f"{first.world_size} rank(s): MiB per rank")
        columns = ("params", "grads", "optimizer", "buffers", "between", "during", "peak", "host")
        lines = [head, f"{'layout':<12}" + "".join(f"{c:>10}" for c in columns)]
        for e in self:
            values = (e.params, e.grads, e.optimizer_state, e.buffers, e.total, e.transient,
                      e.peak, e.host)
            lines.append(f"{e.layout:<12}" + "".join(f"{v / MiB:>10.2f}" for v in values))
        notes = dict.fromkeys(f"{e.layout}: {note}" for e in self for note in e.notes)
        lines += [f"note: {note}" for note in notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Unit:
    """One fully_shard unit as the estimate sees it: its parameter count and dtype."""

    name: str
    numel: int
    dtype: torch.dtype


def estimate_memory(model: nn.Module, *, world_size: int, layout: str, optimizer: str = "adam",
                    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                    offload: str | None = None, units: Iterable[nn.Module | str] | None = None,
                    balance: str | Sequence[int] | None = None,
                    plan: Mapping[str, str] | None = None) -> MemoryEstimate:
    """Estimate the bytes per rank of `model` under `layout` over `world_size` ranks.

    Args:
        model: the one-process model, on any device (meta included), or one already wrapped
            by `td.fully_shard` (its units are then used).
        world_size: N, the ranks the layout splits over (the pipeline's stages, tp's ranks).
        layout: "ddp", "zero", "fully_shard", "pipeline" or "tp" (see `LAYOUTS`).
        optimizer: "adam", "adamw", "sgd" or "sgd-momentum".
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
    """
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
    wrapped = _wrapped_units(model)
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
        return MemoryEstimate(**base, **_replicated(counted, optimizer))
    if layout == "zero":
        return _zero(base, counted, n, optimizer)
    if layout == "fully_shard":
        found = wrapped if wrapped is not None else _planned_units(model, units)
        return _fully_shard(base, found, n, optimizer, param_dtype, reduce_dtype, offload,
                            one_unit=wrapped is None and units is None)
    if layout == "pipeline":
        return _pipeline(base, model, n, optimizer, balance)
    return _tensor_parallel(base, model, n, optimizer, plan)


def compare_memory(model: nn.Module, *, world_size: int, optimizer: str = "adam",
                   layouts: Sequence[str] | None = None, **options) -> MemoryComparison:
    """`estimate_memory` for several layouts (default: every one the model allows), one table.

    Options go to the layouts they apply to: `units`, `param_dtype`, `reduce_dtype`,
    `offload` to fully_shard, `balance` to pipeline, `plan` to tp. Without `plan` tp is left
    out; pipeline is left out of the default for a model that is not an nn.Sequential.
    """
    _check_arguments(world_size, "ddp", optimizer, options.get("offload"))
    takes = {"fully_shard": ("units", "param_dtype", "reduce_dtype", "offload"),
             "pipeline": ("balance",), "tp": ("plan",)}
    unknown = set(options) - {k for keys in takes.values() for k in keys}
    if unknown:
        raise TypeError(f"compare_memory got unknown option(s) {sorted(unknown)}; it takes "
                        f"{sorted(k for keys in takes.values() for k in keys)}")
    if layouts is None:
        layouts = ["ddp", "zero", "fully_shard"]
        if isinstance(model, nn.Sequential) and _wrapped_units(model) is None:
            layouts.append("pipeline")
        if options.get("plan") is not None:
            layouts.append("tp")
    out = []
    for layout in layouts:
        mine = {k: v for k, v in options.items() if k in takes.get(layout, ())}
        out.append(estimate_memory(model, world_size=world_size, layout=layout,
                                   optimizer=optimizer, **mine))
    return MemoryComparison(out)


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


def _wrapped_units(model: nn.Module) -> list[_Unit] | None:
    """The units of a model wrapped by td.fully_shard (root last), None when there are none."""
    from tandem.parallel.fully_shard import units

    found = [(name, unit) for name, unit in units(model)]
    if not found:
        return None
    found.sort(key=lambda item: item[1].is_root)  # the root last, the others in module order
    out = [_Unit(name, unit.numel, unit.shard.dtype) for name, unit in found]
    if not found[-1][1].is_root:  # a root that only holds units: nothing of its own to gather
        out.append(_Unit("", 0, out[-1].dtype))
    return out


def _tensors(model: nn.Module, wrapped: list[_Unit] | None) -> list[tuple[int, int]]:
    """(numel, element size) of every parameter of the unsplit model, each tensor once."""
    from tandem.parallel import splits

    if wrapped is None:
        return [(p.numel(), p.element_size()) for p in model.parameters()]
    # A unit's flat shard stands for its parameters; what no unit owns is a plain parameter.
    plain = [(p.numel(), p.element_size()) for p in model.parameters()
             if splits.kind_of(p) != splits.FULLY_SHARD]
    return [(u.numel, u.dtype.itemsize) for u in wrapped] + plain


def _optimizer_bytes(elements_bytes: int, tensors: int, optimizer: str) -> int:
    """State bytes for parameters of `elements_bytes` bytes in `tensors` tensors."""
    per_element, step = OPTIMIZERS[optimizer]
    return per_element * elements_bytes + (4 * tensors if step else 0)


def _replicated(tensors: list[tuple[int, int]], optimizer: str) -> dict:
    whole = sum(n * size for n, size in tensors)
    return {"params": whole, "grads": whole,
            "optimizer_state": _optimizer_bytes(whole, len(tensors), optimizer)}


def _padded(numel: int, n: int) -> int:
    """One rank's shard of a flat space of `numel` elements (tandem pads it to a multiple of n)."""
    from tandem.parallel.flat_shard import FlatShard

    return FlatShard(numel, n, 0).shard_numel


# -- the layouts --------------------------------------------------------------------------------
def _zero(base: dict, tensors: list[tuple[int, int]], n: int, optimizer: str) -> MemoryEstimate:
    sizes = {size for _, size in tensors}
    if len(sizes) > 1:
        raise ValueError("ZeroOptimizer shards one flat space, so all parameters need one dtype; "
                         "this model mixes dtypes (keep fp32 masters: model.float())")
    size = sizes.pop() if sizes else 4
    whole = sum(n_ for n_, _ in tensors) * size
    shard = _padded(sum(n_ for n_, _ in tensors), n) * size
    return MemoryEstimate(
        **base, params=whole, grads=whole,
        optimizer_state=_optimizer_bytes(shard, 1, optimizer),  # one flat view per param group
        buffers=2 * shard,  # the rank's shard of the parameters and of the averaged gradient
        transient=n * shard,  # step() packs every local gradient into one flat buffer
        notes=("one param group assumed (Adam's step counter is per group)",))


def _planned_units(model: nn.Module, units: Iterable[nn.Module | str] | None) -> list[_Unit]:
    """The units `td.fully_shard` would make of `units` and then the root (each owning the
    parameters no inner unit owns), in module order, the root last."""
    names = {id(m): name for name, m in model.named_modules()}
    chosen: list[nn.Module] = []
    for unit in (units or ()):
        if isinstance(unit, str):
            module = dict(model.named_modules()).get(unit)
            if module is None:
                raise ValueError(f"units: the model has no submodule {unit!r}; give qualified "
                                 f"names from model.named_modules(), e.g. 'blocks.0'")
        elif isinstance(unit, nn.Module):
            module = unit
        else:
            raise TypeError(f"units takes modules or their qualified names, got "
                            f"{type(unit).__name__}")
        if id(module) not in names:
            raise ValueError(f"units: {type(module).__name__} is not a submodule of this model")
        if module is not model:
            chosen.append(module)
    marked = {id(m) for m in chosen}
    seen: set[int] = set()

    def owned(module: nn.Module) -> tuple[int, torch.dtype]:
        """The parameters reached from `module` without entering another unit (once each)."""
        numel, dtype, stack = 0, torch.float32, [module]
        while stack:
            m = stack.pop()
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    numel, dtype = numel + p.numel(), p.dtype
            stack.extend(c for c in m._modules.values() if c is not None and id(c) not in marked)
        return numel, dtype

    # innermost first, as td.fully_shard is applied; reported in module order, the root last
    order = sorted(chosen, key=lambda m: -len(names[id(m)].split(".")))
    made = {id(m): owned(m) for m in order}
    root = owned(model)
    out = [_Unit(names[id(m)], *made[id(m)]) for m in model.modules() if id(m) in made]
    out = [u for u in out if u.numel]  # a unit without parameters of its own holds nothing
    return out + [_Unit("", *root)]


def _fully_shard(base: dict, found: list[_Unit], n: int, optimizer: str,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 offload: str | None, one_unit: bool) -> MemoryEstimate:
    shards = [_padded(u.numel, n) for u in found]
    params = sum(s * u.dtype.itemsize for s, u in zip(shards, found, strict=True))
    notes = ["the peak assumes zero_grad(set_to_none=False); with set_to_none=True (torch's "
             "default) it is lower by the gradients' bytes"]
    if one_unit:
        notes.append("the whole model is one unit (gathered whole): give units= "
                     "(e.g. units=model.blocks) for one unit per block")
    gathered, reducing, casts = [], [], []
    for s, u in zip(shards, found, strict=True):
        compute, reduce = param_dtype or u.dtype, reduce_dtype or u.dtype
        gathered.append(n * s * compute.itemsize)
        # the packed gradient (+ one inf/NaN flag per rank) and, over several ranks, the buffer
        # the reduce-scatter writes this rank's part into (added into an existing .grad)
        reducing.append((n + (n > 1)) * (s + 1) * reduce.itemsize)
        casts.append(n * s * reduce.itemsize if compute != reduce else 0)  # grad.to(reduce)
    return MemoryEstimate(
        **base, params=params, grads=params,
        optimizer_state=_optimizer_bytes(params, len(found), optimizer),
        transient=_step_peak(gathered, reducing, casts), offload=offload, notes=tuple(notes))


def _step_peak(gathered: list[int], reducing: list[int], casts: list[int]) -> int:
    """The most bytes of gathered units and in-flight gradient reductions alive at once.

    `parallel/fully_shard/unit.py`'s schedule, units in forward order, the root last in the
    lists: the root stays gathered from its forward until its own reduce-scatter, which comes
    last in backward; a unit's forward prefetches the next, its backward the one before; a
    unit's gradient (gathered size) is packed for its reduce-scatter, which is waited for at
    the end of backward, so the packed gradients of the units behind it are all still alive.
    """
    *inner, root_g = gathered
    *rs, root_rs = reducing
    *cast, root_cast = casts
    m = len(inner)
    peak = root_g + (inner[0] if inner else 0)
    for k in range(m):
        after = inner[k + 1] if k + 1 < m else 0
        before = inner[k - 1] if k > 0 else 0
        behind = sum(rs[k + 1:])
        peak = max(peak,
                   root_g + inner[k] + after,  # forward: this unit and the prefetched next
                   # backward: this unit, the one prefetched before it, its fresh gradient,
                   # then the gradient cast and packed while the gathered copy is freed
                   root_g + before + inner[k] + inner[k] + behind,
                   root_g + before + inner[k] + cast[k] + rs[k] + behind)
    # the root's own gradient at the very end (its gathered copy freed as it is packed); then
    # every packed gradient until the wait
    return max(peak, root_g + root_g + sum(rs), root_g + root_cast + root_rs + sum(rs))


def _pipeline(base: dict, model: nn.Module, n: int, optimizer: str,
              balance: str | Sequence[int] | None) -> MemoryEstimate:
    from tandem.parallel.pipeline import balance as balancing
    from tandem.parallel.pipeline.build import even

    if not isinstance(model, nn.Sequential):
        raise ValueError(f"layout='pipeline' estimates an nn.Sequential (the layers td.Pipeline "
                         f"splits); got {type(model).__name__}: estimate its nn.Sequential form")
    layers = list(model._modules.values())
    balancing.check_stage_count(len(layers), n)
    if balance is None:
        counts = even(len(layers), n)
    elif balance == "params":
        counts = balancing.partition(balancing.param_costs(layers), n)
    elif isinstance(balance, str):
        raise ValueError(f"balance={balance!r}: the estimate takes None, 'params' or a list of "
                         f"layer counts ('time' needs the model to run)")
    else:
        counts = balancing.check_counts(balance, len(layers), n)
    best, start = None, 0
    for count in counts:  # the largest stage is the one that must fit
        stage = [(p.numel(), p.element_size())
                 for layer in layers[start:start + count] for p in layer.parameters()]
        start += count
        est = _replicated(stage, optimizer)
        if best is None or sum(est.values()) > sum(best.values()):
            best = est
    return MemoryEstimate(**base, **best, notes=(f"stages of {counts} layers; the largest shown; "
                                                 f"activations of micro-batches in flight not counted",))


def _tensor_parallel(base: dict, model: nn.Module, n: int, optimizer: str,
                     plan: Mapping[str, str] | None) -> MemoryEstimate:
    if not plan:
        raise ValueError("layout='tp' needs plan=, the one td.parallelize takes "
                         "({'mlp.0': 'colwise', 'mlp.2': 'rowwise', ...})")
    modules = dict(model.named_modules())
    cut: dict[int, int] = {}  # id(parameter) -> its numel on the largest rank

    def part(size: int) -> int:
        return -(-size // n)

    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            raise ValueError(f"plan names {name!r}, which is not a submodule of this model")
        if style in ("colwise", "colwise_gather"):
            out_features, in_features = module.weight.shape
            cut[id(module.weight)] = part(out_features) * in_features
            if module.bias is not None:
                cut[id(module.bias)] = part(out_features)
        elif style == "rowwise":
            out_features, in_features = module.weight.shape
            cut[id(module.weight)] = out_features * part(in_features)
        elif style == "embedding":
            rows, dim = module.weight.shape
            cut[id(module.weight)] = part(rows) * dim
        elif style == "attention":
            e, heads = module.embed_dim, module.num_heads
            rows = part(heads) * (e // heads)
            cut[id(module.in_proj_weight)] = 3 * rows * e
            if module.in_proj_bias is not None:
                cut[id(module.in_proj_bias)] = 3 * rows
            cut[id(module.out_proj.weight)] = e * rows
        else:
            raise ValueError(f"plan[{name!r}] = {style!r}: choose one of colwise, "
                             f"colwise_gather, rowwise, embedding, attention")
    tensors = [(cut.get(id(p), p.numel()), p.element_size()) for p in model.parameters()]
    return MemoryEstimate(**base, **_replicated(tensors, optimizer),
                          notes=("activations not counted",))
