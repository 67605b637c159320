"""`parallelize(model, plan, group)`: turn named layers of an existing model tensor-parallel.

In the spirit of DTensor's `parallelize_module`: the model is built as for one process (the same
way on every rank), and the plan maps layer names to how each is split:

    "colwise"          nn.Linear   -> ColumnParallelLinear (output stays split)
    "colwise_gather"   nn.Linear   -> ColumnParallelLinear that all-gathers its output
    "rowwise"          nn.Linear   -> RowParallelLinear (input already split)
    "rowwise_split"    nn.Linear   -> RowParallelLinear that slices a replicated input
    "vocab"            nn.Embedding -> VocabParallelEmbedding
    "heads"            an attention module with `num_heads` and Linear children q/k/v/out
                       (also named query/key/value, q_proj/k_proj/v_proj/out_proj, o_proj, proj)
                       -> ParallelAttention

Every rank of the group must call it with the same plan; the group is checked to be the same
on every member before anything is converted.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from torch import nn

from tandem import runtime
from tandem.comm import collectives
from tandem.comm.groups import Group, group_ranks
from tandem.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_LINEAR = {"colwise": (ColumnParallelLinear, {"gather_output": False}),
           "colwise_gather": (ColumnParallelLinear, {"gather_output": True}),
           "rowwise": (RowParallelLinear, {"input_is_parallel": True}),
           "rowwise_split": (RowParallelLinear, {"input_is_parallel": False})}
STYLES = (*_LINEAR, "vocab", "heads")
_HEAD_NAMES = {"q": ("q", "query", "q_proj"), "k": ("k", "key", "k_proj"),
               "v": ("v", "value", "v_proj"), "out": ("out", "out_proj", "o_proj", "proj")}


def _find(model: nn.Module, name: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name not in modules:
        close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"parallelize: the plan names layer {name!r}, which {type(model).__name__} "
                         f"does not have{hint} (see model.named_modules())")
    return modules[name]


def _attention(module: nn.Module, name: str, group: Group | None) -> ParallelAttention:
    heads = getattr(module, "num_heads", None)
    children = dict(module.named_children())
    found = {}
    for role, names in _HEAD_NAMES.items():
        hits = [children[n] for n in names if isinstance(children.get(n), nn.Linear)]
        found[role] = hits[0] if hits else None
    missing = [role for role, m in found.items() if m is None]
    if not isinstance(heads, int) or missing:
        raise ValueError(
            f"parallelize: style 'heads' for {name!r} needs an int attribute num_heads and nn.Linear "
            f"children for q, k, v and out ({_HEAD_NAMES}); {type(module).__name__} has "
            f"num_heads={heads!r}, missing {missing}")
    return ParallelAttention(found["q"], found["k"], found["v"], found["out"], heads, group,
                             causal=bool(getattr(module, "causal", False)))


def _convert(module: nn.Module, name: str, style: str, group: Group | None) -> nn.Module:
    if style == "heads":
        return _attention(module, name, group)
    expected = nn.Embedding if style == "vocab" else nn.Linear
    if not isinstance(module, expected):
        raise ValueError(f"parallelize: style {style!r} for {name!r} needs an {expected.__name__}, "
                         f"got {type(module).__name__}")
    if style == "vocab":
        return VocabParallelEmbedding.from_full(module, group)
    cls, options = _LINEAR[style]
    return cls.from_full(module, group, **options)


def check_group(group: Group | None, plan: Mapping[str, str]) -> None:
    """Every rank must see the same members in its tp group and the same plan, or none converts."""
    mine = (runtime.rank(), group_ranks(group), sorted(plan.items()))
    views = collectives.allgather_object(mine, group=group)
    odd = [(r, ranks, p) for r, ranks, p in views if (ranks, p) != mine[1:]]
    if odd:
        lines = "; ".join(f"rank {r} has tp group {list(ranks)} and plan {dict(p)}" for r, ranks, p in odd)
        raise ValueError(f"parallelize: rank {mine[0]} has tp group {list(mine[1])} and plan "
                         f"{dict(mine[2])}, but {lines}; build the tp groups and the plan the same "
                         f"way on every rank (e.g. td.mesh(dp=, tp=).tp_group)")


def parallelize(model: nn.Module, plan: Mapping[str, str], group: Group | None = None) -> nn.Module:
    """Replace the named layers of `model` in place by their tensor-parallel versions; returns it."""
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"parallelize: unknown style {style!r} for {name!r}; use one of {STYLES}")
        _find(model, name)
    if group is not None and group.rank < 0:
        raise ValueError(f"parallelize: this rank is not a member of {group!r}; call it on members only")
    check_group(group, plan)
    for name, style in plan.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        converted = _convert(getattr(parent, child), name, style, group)
        setattr(parent, child, converted)
    return model
