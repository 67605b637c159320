"""The formulas of the layouts whose bytes follow from parameter counts alone: ddp, zero,
pipeline and tp (fully_shard's schedule is in `sharded.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from tandem.parallel.memory.report import MemoryEstimate

#: Per-element state tensors each optimizer keeps (each of the parameter's dtype), and whether
#: it keeps a scalar `step` tensor per parameter (4 bytes: torch's Adam does).
OPTIMIZERS = {"adam": (2, True), "adamw": (2, True), "sgd": (0, False), "sgd-momentum": (1, False)}


def optimizer_bytes(elements_bytes: int, tensors: int, optimizer: str) -> int:
    """State bytes for parameters of `elements_bytes` bytes in `tensors` tensors."""
    per_element, step = OPTIMIZERS[optimizer]
    return per_element * elements_bytes + (4 * tensors if step else 0)


def replicated(tensors: list[tuple[int, int]], optimizer: str) -> dict:
    whole = sum(n * size for n, size in tensors)
    return {"params": whole, "grads": whole,
            "optimizer_state": optimizer_bytes(whole, len(tensors), optimizer)}


def padded(numel: int, n: int) -> int:
    """One rank's shard of a flat space of `numel` elements (tandem pads it to a multiple of n)."""
    from tandem.parallel.layout.flat_shard import FlatShard

    return FlatShard(numel, n, 0).shard_numel


# -- the layouts --------------------------------------------------------------------------------
def zero(base: dict, tensors: list[tuple[int, int]], n: int, optimizer: str) -> MemoryEstimate:
    sizes = {size for _, size in tensors}
    if len(sizes) > 1:
        raise ValueError("ZeroOptimizer shards one flat space, so all parameters need one dtype; "
                         "this model mixes dtypes (keep fp32 masters: model.float())")
    size = sizes.pop() if sizes else 4
    whole = sum(n_ for n_, _ in tensors) * size
    shard = padded(sum(n_ for n_, _ in tensors), n) * size
    return MemoryEstimate(
        **base, params=whole, grads=whole,
        optimizer_state=optimizer_bytes(shard, 1, optimizer),  # one flat view per param group
        buffers=2 * shard,  # the rank's shard of the parameters and of the averaged gradient
        transient=n * shard,  # step() packs every local gradient into one flat buffer
        notes=("one param group assumed (Adam's step counter is per group)",))


def pipeline(base: dict, model: nn.Module, n: int, optimizer: str,
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
        est = replicated(stage, optimizer)
        if best is None or sum(est.values()) > sum(best.values()):
            best = est
    return MemoryEstimate(**base, **best, notes=(f"stages of {counts} layers; the largest shown; "
                                                 f"activations of micro-batches in flight not counted",))


def tensor_parallel(base: dict, model: nn.Module, n: int, optimizer: str,
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
    return MemoryEstimate(**base, **replicated(tensors, optimizer),
                          notes=("activations not counted",))
