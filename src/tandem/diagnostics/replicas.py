"""`check_replicas`: are the data-parallel replicas still identical?

Replicas drift apart silently (a rank that skipped a step, a forgotten broadcast, a
non-deterministic kernel), and the symptom is a loss curve that looks fine. The check is cheap
enough to run every few hundred steps:

1. each rank reduces every tensor to two 64-bit checksums of its bytes (a plain sum and a
   position-weighted sum, so both changed values and swapped values show up);
2. one all-gather of those checksums (plus a hash of the tensor names and shapes) tells every
   rank which tensors differ;
3. only those tensors are compared in full (broadcast from the group's first rank), to say by
   how much. With `atol > 0` every tensor is compared in full, as bytes cannot tell whether a
   difference is within tolerance.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement.agree import agree_layout, describe_tensors
from tandem.comm.collectives import user as collectives
from tandem.comm.collectives.tensors import coalesced, module_tensors
from tandem.comm.groups import Group, group_ranks, group_size

_WEIGHT_PERIOD = 65_521  # a prime: weights 1..65521 repeat, never align with power-of-two shapes


class ReplicaMismatchError(RuntimeError):
    """Replicas that should hold identical tensors do not."""


def _named(model: nn.Module | Mapping[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """The tensors to compare, and the names of those that are buffers (not parameters)."""
    if isinstance(model, nn.Module):
        named = module_tensors(model)
        parameters = {id(p) for p in model.parameters()}
        return named, {name for name, t in named if id(t) not in parameters}
    if isinstance(model, Mapping):
        return [(str(k), v) for k, v in model.items() if isinstance(v, torch.Tensor)], set()
    raise TypeError(f"check_replicas takes an nn.Module or a state dict, not {type(model).__name__}")


def checksums(tensor: torch.Tensor) -> tuple[int, int]:
    """Two checksums of the tensor's bytes: equal bytes give equal sums on any rank."""
    data = tensor.detach().contiguous().reshape(-1)
    if data.numel() == 0:
        return 0, 0
    raw = data.view(torch.uint8)
    aligned = raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0
    words = raw.view(torch.int32) if aligned else raw
    words = words.to(torch.int64)  # int64 sums wrap around instead of losing bits
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
    return int(words.sum()), int((words * weights).sum())


def _difference(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine - reference| (inf where one is NaN and the other is not)."""
    if mine.numel() == 0:
        return 0.0
    if not (mine.is_floating_point() or mine.is_complex()):
        return float((mine.long() - reference.long()).abs().max())
    wide = torch.complex128 if mine.is_complex() else torch.float64
    a, b = mine.detach().to(wide), reference.to(wide)
    both_nan = torch.isnan(a) & torch.isnan(b)
    difference = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    return float(torch.nan_to_num(difference, nan=float("inf")).max())


BUFFER_POLICIES = ("warn", "strict", "ignore")


_BUFFER_ADVICE = (
    "\nBuffers that differ are usually per-rank statistics (BatchNorm running mean/var of each "
    "rank's own shard), expected without SyncBatchNorm. To make them equal: convert the model "
    "with td.SyncBatchNorm.convert(model) before training, or call td.broadcast_buffers(model) "
    "before evaluating or saving."
)


class ReplicaBufferWarning(UserWarning):
    """Buffers (e.g. BatchNorm running statistics) differ between replicas."""


def check_replicas(
    model: nn.Module | Mapping[str, Any],
    group: Group | None = None,
    atol: float = 0.0,
    buffers: str = "warn",
    skip: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """Return if every rank of `group` holds the same parameters, else raise.

    `ReplicaMismatchError` (raised on every rank) names each parameter that differs, the ranks
    whose copy differs from the group's first rank, and the largest absolute difference.
    `atol=0` asks for bit-identical replicas; `atol > 0` accepts differences up to `atol`.

    Buffers of a module are compared too, but per-rank buffers are expected in data
    parallelism: plain BatchNorm keeps running statistics of each rank's own shard. With
    `buffers="warn"` (default) those that differ are named in a `ReplicaBufferWarning` with
    the ways to make them equal; `buffers="strict"` makes them an error like parameters;
    `buffers="ignore"` skips them. A state dict has no buffer/parameter distinction: every
    tensor in it is held to the parameters' standard. `skip(tensor)`: tensors that are not
    replicas (a split model's pieces, which `td.check_replicas` leaves out).
    """
    if buffers not in BUFFER_POLICIES:
        raise ValueError(f"buffers must be one of {', '.join(map(repr, BUFFER_POLICIES))}, got {buffers!r}")
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    named, buffer_names = _named(model)
    if skip is not None:
        named = [(n, t) for n, t in named if not skip(t)]
    if buffers == "ignore":
        named = [(n, t) for n, t in named if n not in buffer_names]
    if group_size(group) == 1:
        return
    agree_layout("check_replicas", describe_tensors(named), group, always=True)
    ranks = group_ranks(group)
    if atol == 0:
        local = torch.tensor([c for _, t in named for c in checksums(t)], dtype=torch.int64)
        gathered = collectives.allgather(local.reshape(-1, 2), group=group)
        per_rank = gathered.reshape(len(ranks), len(named), 2)
        suspects = [i for i in range(len(named)) if not bool((per_rank[:, i] == per_rank[0, i]).all())]
    else:
        suspects = list(range(len(named)))
    if not suspects:
        return
    # Full comparison of the suspects: the first rank's copies, broadcast in a few messages.
    references = [named[i][1].detach().clone() for i in suspects]
    coalesced(references, lambda flat: collectives.broadcast(flat, ranks[0], inplace=True, group=group),
              copy_back=runtime.rank() != ranks[0])
    local_differences = torch.tensor(
        [_difference(named[i][1], ref) for i, ref in zip(suspects, references, strict=True)],
        dtype=torch.float64,
    )
    differences = collectives.allgather(local_differences.reshape(-1, 1), group=group)
    differences = differences.reshape(len(ranks), len(suspects))
    problems, buffer_problems = [], []
    for k, i in enumerate(suspects):
        name, tensor = named[i]
        bad = [(r, float(differences[j, k])) for j, r in enumerate(ranks)
               if not float(differences[j, k]) <= atol]
        if atol == 0 and not bad:
            # Bytes differ but values compare equal (+0.0 vs -0.0): report it all the same.
            bad = [(r, 0.0) for j, r in enumerate(ranks)
                   if not bool((per_rank[j, i] == per_rank[0, i]).all())]
        if bad:
            detail = ", ".join(f"rank {r} by up to {d:.3g}" for r, d in bad)
            line = f"  {name} {tuple(tensor.shape)}: differs from rank {ranks[0]} on {detail}"
            lenient = name in buffer_names and buffers == "warn"
            (buffer_problems if lenient else problems).append(line)
    if problems:
        raise ReplicaMismatchError(
            f"replicas diverged: {len(problems)} of {len(named)} tensors differ (atol={atol}):\n"
            + "\n".join(problems)
            + "\nBroadcast them from one rank (td.broadcast_parameters) and look for a rank that "
            "skipped a step or used a different seed or data."
            + (_BUFFER_ADVICE if any(line.split()[0] in buffer_names for line in problems) else "")
        )
    if buffer_problems:
        warnings.warn(
            f"check_replicas: the parameters are identical, but {len(buffer_problems)} buffer(s) "
            f"differ between ranks:\n" + "\n".join(buffer_problems)
            + _BUFFER_ADVICE + " check_replicas(model, buffers='strict') makes this an error.",
            ReplicaBufferWarning,
            stacklevel=2,
        )
