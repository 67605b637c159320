"""Building a `Pipeline`: how the layers are split, the ranks' one agreement, this rank's stage.

Construction is the one moment the ranks compare their arguments (afterwards they only
exchange tensors). A rank that fails must not leave the others waiting for it, so every rank
puts its error or its plan into one agreement (`tandem.comm.agreement.agree`: one small all-reduce
when all is well), and all of them raise together when one failed or they differ.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from tandem.comm.agreement.agree import agree
from tandem.comm.collectives.user import broadcast_object
from tandem.parallel.pipeline import balance as balancing


def even(num_layers: int, num_stages: int) -> list[int]:
    """Like torch.tensor_split: the first num_layers % num_stages stages get one more."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def to_device(value, device: torch.device):
    """A tensor, or a tuple/list of them, on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def plan(module, balance, sample, num_stages: int, stage_index: int) -> list[int] | None:
    """This rank's layer counts per stage (None: stage 0 decides, or a list of stages)."""
    p = num_stages
    if isinstance(module, nn.Sequential):
        layers = list(module._modules.values())
        balancing.check_stage_count(len(layers), p)
        if balance is None:
            return even(len(layers), p)
        if balance == "params":
            return balancing.partition(balancing.param_costs(layers), p)
        if balance == "time":
            if stage_index != 0:
                return None
            if sample is None:
                raise ValueError(
                    "balance='time' profiles the layers on an input: pass sample=<an input "
                    "batch> (needed on the first stage's rank), or use balance='params'"
                )
            where = next((q.device for q in module.parameters()), torch.device("cpu"))
            return balancing.partition(balancing.time_costs(layers, to_device(sample, where), where), p)
        if isinstance(balance, str):
            raise ValueError(f"unknown balance {balance!r}: a list of layer counts, 'params' or 'time'")
        return balancing.check_counts(balance, len(layers), p)
    if isinstance(module, (list, tuple)):
        if balance is not None:
            raise ValueError(
                f"balance={balance!r} applies to an nn.Sequential; a list of stages already "
                f"fixes the split (one entry per stage)"
            )
        if len(module) != p:
            raise ValueError(
                f"got a list of {len(module)} stages for a pipeline group of {p} ranks: give "
                f"exactly one stage (module or factory) per rank"
            )
        bad = [k for k, m in enumerate(module) if not callable(m)]
        if bad:
            raise TypeError(f"stages {bad} are neither nn.Module nor a factory (callable)")
        return None
    raise TypeError(
        f"Pipeline takes an nn.Sequential or a list of stage modules/factories, got "
        f"{type(module).__name__}"
    )


def describe_arguments(module, chunks, schedule, balance, counts) -> dict:
    """What the ranks must agree on."""
    return {
        "chunks": chunks,
        "schedule": schedule,
        "layers": len(module) if isinstance(module, (nn.Sequential, list, tuple)) else None,
        "balance": list(balance) if isinstance(balance, (list, tuple)) else balance,
        "counts": counts,
    }


def settle(error: BaseException | None, group, ranks, doing: str, mine: dict | None = None) -> None:
    """Raise on every rank if any rank failed, or if the ranks' descriptions `mine` differ.

    Where a rank failed it raises its own error; the others raise one of the same type that
    names the failing stage. One all-reduce when every rank is fine and agrees (see
    `tandem.comm.agreement.agree`); every rank's description is exchanged only when one is not.
    """
    mine = dict(mine or {}, error=None if error is None else (type(error).__name__, str(error)))

    def explain(_, everyone: list[dict]) -> str | BaseException:
        if error is not None:
            return error
        failed = [(s, c["error"]) for s, c in enumerate(everyone) if c["error"]]
        if failed:
            stage, (kind, message) = failed[0]
            also = f" (stages {[s for s, _ in failed]} all failed)" if len(failed) > 1 else ""
            text = f"Pipeline stage {stage} (rank {ranks[stage]}) {doing}{also}: {message}"
            return {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(text)
        return _disagreement(everyone, ranks)

    agree(mine, group, explain=explain)
    if error is not None:  # every rank failed alike: each raises its own
        raise error


def _disagreement(everyone: list[dict], ranks) -> str:
    for key in ("chunks", "schedule", "layers", "balance"):
        values = [c[key] for c in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {ranks[s]} {key}={v!r}" for s, v in enumerate(values))
            return f"the pipeline's ranks disagree: {listing}; pass the same on every rank"
    listing = ", ".join(f"rank {ranks[s]}: {c.get('counts')}" for s, c in enumerate(everyone))
    return f"the ranks split the model differently ({listing}): build the same model everywhere"


def agree_on_plan(mine: dict, error: BaseException | None, group, ranks, balance) -> list[int]:
    """The layer counts every rank will use; raised on every rank if one failed or they differ.

    With balance="time" only the first stage profiled the layers: the others take its split.
    """
    timed = balance == "time"
    settle(error, group, ranks, "rejected its arguments",
           {key: value for key, value in mine.items() if not (timed and key == "counts")})
    if timed and len(ranks) > 1:
        return broadcast_object(mine["counts"], root=ranks[0], group=group)
    return mine["counts"]


def select(module, counts, stage_index: int) -> tuple[nn.Module, str, list[nn.Module]]:
    """(this rank's stage, the prefix of its parameter names, the other stages' modules)."""
    s = stage_index
    if isinstance(module, nn.Sequential):
        names = list(module._modules)
        start = sum(counts[:s])
        mine = names[start : start + counts[s]]
        # Keep the original keys, so the stage's parameter names are the model's (`3.weight`).
        stage = nn.Sequential(OrderedDict((k, module._modules[k]) for k in mine))
        others, prefix = [module._modules[k] for k in names if k not in mine], ""
    else:
        item = module[s]
        stage = item if isinstance(item, nn.Module) else item()
        if not isinstance(stage, nn.Module):
            raise TypeError(f"the factory for stage {s} returned {type(stage).__name__}, not an nn.Module")
        others = [m for k, m in enumerate(module) if k != s and isinstance(m, nn.Module)]
        prefix = f"{s}."  # as if the stages were the children of one nn.Sequential
    kept = {id(q) for q in stage.parameters()} | {id(m) for m in stage.modules()}
    for other in others:
        if id(other) in kept or any(id(q) in kept for q in other.parameters()):
            raise ValueError(
                f"stage {s} shares a layer or parameter with another stage (tied weights): "
                f"each stage must own its parameters"
            )
    return stage, prefix, others


def free(others: list[nn.Module]) -> None:
    """Release the other stages' parameters and buffers (the modules stay, on the meta device)."""
    for other in others:
        other.to("meta")
