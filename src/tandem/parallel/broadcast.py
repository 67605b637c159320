"""Make replicas start equal: broadcast parameters, buffers and optimizer state from one rank.

    td.broadcast_parameters(model)             # after building the model, before training
    td.broadcast_optimizer_state(optimizer)    # after building (or loading) the optimizer

Tensors travel flattened: every tensor of one dtype and device is packed into one buffer (split
at `tandem.comm.collectives.tensors.MESSAGE_BYTES`), so a model of hundreds of tensors costs a handful of
messages.

The optimizer state's copy is `parallel/optimizer_broadcast.py` (the owners' `copy_from` uses
it; the model side here asks the owners what is replicated). The packing (`coalesced`,
`each_once`) is `tandem.comm.collectives.tensors`; the one check that every rank holds the same
tensors (`agree_layout`) is `tandem.comm.agreement.agree`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement.agree import agree_layout, describe_tensors
from tandem.comm.collectives.tensors import coalesced, each_once, module_tensors
from tandem.comm.groups import Group, group_ranks, group_size
from tandem.diagnostics import replicas
from tandem.parallel.layout import splits
from tandem.parallel.layout.owner import owner_of, split_across
from tandem.parallel.optimizer_broadcast import broadcast_optimizer_state as broadcast_optimizer_state
from tandem.parallel.optimizer_broadcast import broadcaster, check_root


def _named_tensors(model_or_state_dict: nn.Module | Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_or_state_dict, nn.Module):
        return module_tensors(model_or_state_dict)
    if isinstance(model_or_state_dict, Mapping):
        return [(str(k), v) for k, v in model_or_state_dict.items() if isinstance(v, torch.Tensor)]
    raise TypeError(
        f"broadcast_parameters takes an nn.Module or a state dict (a mapping of names to tensors), "
        f"not {type(model_or_state_dict).__name__}"
    )


def _pieces(model_or_state_dict: Any, group: Group | None) -> dict[int, str]:
    """The tensors (by id) that `group`'s ranks hold different parts of, and how they are split:
    the model's owner answers (`parallel/layout/owner.py`); a state dict's tensors one by one."""
    if isinstance(model_or_state_dict, nn.Module):
        return owner_of(model_or_state_dict).not_replicated(group)
    if not isinstance(model_or_state_dict, Mapping):
        return {}  # refused by the caller, with its own words
    return {id(t): kind for t in model_or_state_dict.values()
            if isinstance(t, torch.Tensor) and (kind := split_across(t, group)) is not None}


def broadcast_parameters(
    model_or_state_dict: nn.Module | Mapping[str, Any],
    root: int | None = None,
    group: Group | None = None,
) -> None:
    """Copy `root`'s parameters and buffers into every rank's, in place.

    Takes a module (parameters and buffers) or a state dict (its tensor values; other values
    are left alone). Every rank must pass the same tensors, in the same order: a mismatch is an
    error that names the first differing tensor and rank. `root` defaults to the group's first
    rank (rank 0 for the world).

    A split model is asked how it is split: `td.fully_shard` shards are left alone (each rank
    holds its own part, made from one rank's values when the model was sharded), and copying
    one rank's tensor-parallel slices (or `td.tensor.Branches`) onto ranks that hold other slices is
    refused: pass the group of ranks that hold the same slices, `group=mesh.dp_group`.

    Args:
        model_or_state_dict: an `nn.Module`, or a state dict whose tensors are overwritten.
        root: the global rank whose values are copied (None: the group's first rank).
        group: the ranks that receive them (None: the world).

    Raises:
        LayoutMismatchError: the ranks passed other tensors (names, shapes or dtypes); the
            first that differs and its rank are named.
        ValueError: `root` is not a rank of `group`, or the copy would overwrite
            tensor-parallel slices with another rank's slice (pass `group=mesh.dp_group`).
    """
    named = _named_tensors(model_or_state_dict)
    if root is None:
        root = group_ranks(group)[0]
    check_root(root, group)
    pieces = _pieces(model_or_state_dict, group)
    named = [(name, t) for name, t in named if pieces.get(id(t)) != splits.FULLY_SHARD]
    mixed = [name for name, t in named if id(t) in pieces]
    if mixed and pieces[id(dict(named)[mixed[0]])] == splits.BRANCH:
        raise ValueError(
            f"broadcast_parameters over ranks {list(group_ranks(group))} would copy rank {root}'s "
            f"td.tensor.Branches branch {mixed[0]!r} onto ranks that hold other branches under "
            f"that name, corrupting the model: broadcast within the ranks that hold the same "
            f"branches, td.broadcast_parameters(model, group=mesh.dp_group) (a "
            f"td.DistributedDataParallel model: give it group=mesh.dp_group too)")
    if mixed:
        raise ValueError(
            f"broadcast_parameters over ranks {list(group_ranks(group))} would copy rank {root}'s "
            f"tensor-parallel slice of {mixed[0]!r} onto ranks that hold other slices, "
            f"corrupting the model: broadcast within the ranks that hold the same slices, "
            f"td.broadcast_parameters(model, group=mesh.dp_group) (parallelize already made "
            f"every slice from its tensor-parallel group's first rank's layer)")
    if group_size(group) == 1:
        return
    agree_layout("broadcast_parameters", describe_tensors(named), group)
    is_root = runtime.rank() == root
    coalesced((t for _, t in named), broadcaster(root, group), copy_back=not is_root)


def broadcast_buffers(model: nn.Module, root: int = 0, group: Group | None = None) -> None:
    """Copy `root`'s buffers (BatchNorm running statistics, ...) into every rank's, in place.

    Without SyncBatchNorm each rank's BatchNorm keeps statistics of its own shard; call this
    before evaluating or saving so that every replica evaluates the same model. Parameters are
    not touched (data parallelism keeps them identical).

    Args:
        model: the module whose buffers are overwritten.
        root: the global rank whose buffers are copied.
        group: the ranks that receive them (None: the world).

    Raises:
        LayoutMismatchError: the ranks' modules have other buffers (names, shapes or dtypes).
        ValueError: `root` is not a rank of `group`.
        TypeError: `model` is not an `nn.Module`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"broadcast_buffers takes an nn.Module, not {type(model).__name__}")
    named = each_once(model.named_buffers())
    check_root(root, group)
    if group_size(group) == 1 or not named:
        return
    agree_layout("broadcast_buffers", describe_tensors(named), group)
    coalesced((t for _, t in named), broadcaster(root, group), copy_back=runtime.rank() != root)


def check_replicas(model: nn.Module | Mapping[str, Any], group: Group | None = None,
                   atol: float = 0.0, buffers: str = "warn") -> None:
    """Return if every rank of `group` holds the same replicated tensors, else raise
    `ReplicaMismatchError` naming each that differs (see `diagnostics.replicas`).

    A split model is asked how it is split: `td.fully_shard` shards and tensor-parallel slices
    that differ across `group` are pieces, not replicas, and are left out (pass
    `group=mesh.dp_group` to compare the ranks that hold the same slices).

    Args:
        model: an `nn.Module` (parameters and buffers) or a state dict (every tensor compared
            as a parameter).
        group: the ranks that must hold the same values (None: the world).
        atol: the largest absolute difference still counted as equal.
        buffers: "warn" (the default) names differing buffers in a `ReplicaBufferWarning`;
            "strict" makes them an error like parameters; "ignore" skips them.

    Raises:
        ReplicaMismatchError: a parameter differs across the ranks (raised on every rank, each
            differing parameter and the ranks named).
        ValueError: an unknown `buffers` policy, or a negative `atol`.
    """
    pieces = _pieces(model, group)
    replicas.check_replicas(model, group, atol, buffers, skip=lambda tensor: id(tensor) in pieces)
