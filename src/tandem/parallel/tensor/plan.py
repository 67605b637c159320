"""Convert an existing model's layers by name: `parallelize(model, plan, group)`.

    plan = {"attn": "attention", "mlp.0": "colwise", "mlp.2": "rowwise"}
    model = parallelize(model, plan, group=mesh.tp_group)

In the spirit of DTensor's `parallelize_module`: the model is written for one process, the
plan says how each named layer is split, and the layers are swapped in place for their
tensor-parallel versions, with shards sliced from the layer's own weights (so every rank
starts from the one-process model). Styles:

    "colwise"         nn.Linear -> ColumnParallelLinear (output stays split)
    "colwise_gather"  nn.Linear -> ColumnParallelLinear(gather_output=True)
    "rowwise"         nn.Linear -> RowParallelLinear (input split, output summed)
    "embedding"       nn.Embedding -> VocabParallelEmbedding
    "attention"       nn.MultiheadAttention -> ParallelSelfAttention (heads split)

`full_state_dict(model)` gathers the one-process state dict back (for a checkpoint that loads
at any tp size: load it into the one-process model, then `parallelize` again).

A "colwise" layer's output stays split: the layer that reads it must be its "rowwise" partner
(or the loss `vocab_parallel_cross_entropy`). A plain `nn.Linear` after it in an
`nn.Sequential` is refused here; elsewhere the first forward names it (instead of torch's
"mat1 and mat2 shapes cannot be multiplied"). The model's forwards and backwards then each
open with one agreement over the group (`parallel/model_check.py`): a rank that skips one is
named, as are ranks given inputs of different shapes. That agreement covers every collective
of the layers inside (`guard`): they go straight to the engine, with no check of their own.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping

import torch
from torch import nn

from tandem.comm import context
from tandem.comm.agreement import agree as agreement
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_ranks, group_size
from tandem.parallel import model_check
from tandem.parallel.broadcast import broadcast_parameters
from tandem.parallel.layout import splits
from tandem.parallel.tensor import guard
from tandem.parallel.tensor.attention import ParallelSelfAttention
from tandem.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_STYLES = {
    "colwise": (nn.Linear, lambda m, g: ColumnParallelLinear.from_linear(m, group=g)),
    "colwise_gather": (nn.Linear, lambda m, g: ColumnParallelLinear.from_linear(
        m, gather_output=True, group=g)),
    "rowwise": (nn.Linear, lambda m, g: RowParallelLinear.from_linear(m, group=g)),
    "embedding": (nn.Embedding, lambda m, g: VocabParallelEmbedding.from_embedding(m, group=g)),
    "attention": (nn.MultiheadAttention,
                  lambda m, g: ParallelSelfAttention.from_multihead(m, group=g)),
}
_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelSelfAttention)


def parallelize(model: nn.Module, plan: Mapping[str, str], group: Group | None = None) -> nn.Module:
    """Swap the layers named in `plan` for tensor-parallel ones over `group`; returns `model`.

    Every rank of the world calls it (each with its own tp group); the ranks of one group must
    pass the same plan and the same model layout.

    Args:
        model: the one-process model; each group slices its first rank's values.
        plan: layer name (as in `model.named_modules()`) to style: "colwise" (an nn.Linear's
            output features split), "colwise_gather" (split, then gathered), "rowwise" (input
            features split, the partial products summed), "embedding" (an nn.Embedding's
            vocabulary split) or "attention" (an nn.MultiheadAttention's heads split).
        group: this rank's tensor-parallel group (`mesh.tp_group`; default: the world).

    Returns:
        `model` itself, the planned layers swapped in place.

    Raises:
        ValueError: an unknown style, a name that is not a layer of `model` (close names
            suggested), a colwise layer whose output an unsplit layer reads (make it rowwise, or
            colwise_gather), or sizes not divisible by the group's size.
        TypeError: a style given to a layer of another kind (colwise to an nn.Conv2d).
        CollectiveMismatchError: the ranks built other tensor-parallel groups.
        LayoutMismatchError: the ranks of a group passed other plans or model layouts (each
            rank's named).
    """
    _check_groups(group)
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style not in _STYLES:
            raise ValueError(f"plan[{name!r}] = {style!r}: choose one of {', '.join(_STYLES)}")
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"the plan names {name!r}, which is not a layer of "
                             f"{type(model).__name__}{hint}")
        kind, _ = _STYLES[style]
        if not isinstance(modules[name], kind):
            raise TypeError(f"plan[{name!r}] = {style!r} needs an nn.{kind.__name__}, but "
                            f"{name!r} is {type(modules[name]).__name__}")
    layout = [f"{name}:{style}:{tuple(modules[name].state_dict()['weight'].shape)}"
              if "weight" in modules[name].state_dict() else f"{name}:{style}"
              for name, style in sorted(plan.items())]
    agreement.agree_layout("tensor-parallel plan", layout, group, always=True)
    split = {name: modules[name].out_features for name, style in plan.items() if style == "colwise"}
    _refuse_plain_consumers(model, plan, split, group_size(group))
    _same_start(model, group)
    for name, style in plan.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _STYLES[style][1](modules[name], group))
    _guard_first_inputs(model, plan, split, group_size(group))
    model_check.watch(model, "tensor-parallel", layout, group, explain_inputs=guard.explain_inputs)
    guard.cover(model, group, None)  # its layers' collectives then go straight to the engine
    return model


def _same_start(model: nn.Module, group: Group | None) -> None:
    """Every rank of the group slices the same one-process model: its first rank's, whatever
    seed each rank built it with (as td.fully_shard takes one rank's values). Ranks that built
    different models would otherwise train a mix of them; broadcast_parameters cannot fix it
    afterwards, the slices being different by then. Tensors already split are left alone."""
    if group_size(group) == 1:
        return
    whole = [t for t in (*model.parameters(), *model.buffers()) if splits.split_of(t) is None]
    broadcast_parameters({str(i): t for i, t in enumerate(whole)}, group=group)


def _unsplit(consumer: str, features: int, got: int, producer: str, full: int, tp: int) -> str:
    return (f"layer {consumer!r} (nn.Linear, in_features={features}) reads the output of the "
            f"colwise layer {producer!r}, which stays split over the {tp} ranks of its "
            f"tensor-parallel group ({full} / {tp} = {got} features each): give {consumer!r} the "
            f"style 'rowwise' (colwise's partner: it sums the split product), or make "
            f"{producer!r} 'colwise_gather' to gather its output")


def _refuse_plain_consumers(model: nn.Module, plan: Mapping[str, str], split: dict[str, int],
                            tp: int) -> None:
    """In an nn.Sequential, the next layer with parameters after a colwise one must be rowwise."""
    if not split or tp == 1:
        return
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        producer = None
        for child_name, child in container.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if producer is not None and any(True for _ in child.parameters()):
                if isinstance(child, nn.Linear) and plan.get(name) != "rowwise":
                    raise ValueError(_unsplit(name, child.in_features, split[producer] // tp,
                                              producer, split[producer], tp))
                producer = None
            if name in split:
                producer = name


def _guard_first_inputs(model: nn.Module, plan: Mapping[str, str], split: dict[str, int],
                        tp: int) -> None:
    """Elsewhere, each plain nn.Linear checks its first input: split features are named."""
    if not split or tp == 1:
        return
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name not in plan:
            handles: list = []
            handles.append(module.register_forward_pre_hook(
                functools.partial(_first_input, name, split, tp, handles)))


def _first_input(name: str, split: dict[str, int], tp: int, handles: list, module: nn.Linear,
                 args) -> None:
    for handle in handles:  # once: a layer that took its first input right takes the rest
        handle.remove()
    got = args[0].shape[-1] if args and isinstance(args[0], torch.Tensor) else None
    if got is None or got == module.in_features:
        return
    for producer, full in split.items():
        if full == module.in_features and got == full // tp:
            raise ValueError(_unsplit(name, module.in_features, got, producer, full, tp))


def _check_groups(group: Group | None) -> None:
    """Every rank's tp group must be the one its members name: else say who thinks what."""
    mine = list(group_ranks(group))
    everyone = agreement.everyone(mine, None, context.current())
    wrong = [f"rank {r} uses tp group {g}, but rank {m} of it uses {everyone[m]}"
             for r, g in enumerate(everyone) for m in g if everyone[m] != g or r not in g]
    if wrong:
        raise agreement.CollectiveMismatchError(
            "ranks disagree on their tensor-parallel groups:\n  " + "\n  ".join(wrong[:8])
            + "\nBuild the groups the same way on every rank (td.mesh(dp=, tp=) does).")


def is_parallelized(model: nn.Module) -> bool:
    """Whether `parallelize` split any of the model's layers."""
    return any(isinstance(m, _PARALLEL) for m in model.modules())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The one-process state dict of a model converted by `parallelize` (every rank calls it):
    `model.state_dict()`, whose hooks gather the slices, with tensors of its own."""
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
