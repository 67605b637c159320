"""Make replicas start equal: broadcast parameters, buffers and optimizer state from one rank.

    td.broadcast_parameters(model)             # after building the model, before training
    td.broadcast_optimizer_state(optimizer)    # after building (or loading) the optimizer

Tensors travel flattened: every tensor of one dtype and device is packed into one buffer (split
at `tandem.comm.collectives.tensors.MESSAGE_BYTES`), so a model of hundreds of tensors costs a handful of
messages.

The packing (`coalesced`, `each_once`) is `tandem.comm.collectives.tensors`; the one check that every rank
holds the same tensors (`agree_layout`) is `tandem.comm.agreement.agree`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement.agree import agree_layout, describe_tensors
from tandem.comm.collectives import user as collectives
from tandem.comm.collectives.tensors import coalesced, each_once, module_tensors
from tandem.comm.groups import Group, group_ranks, group_size
from tandem.diagnostics import replicas
from tandem.parallel.layout import splits


def _named_tensors(model_or_state_dict: nn.Module | Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_or_state_dict, nn.Module):
        return module_tensors(model_or_state_dict)
    if isinstance(model_or_state_dict, Mapping):
        return [(str(k), v) for k, v in model_or_state_dict.items() if isinstance(v, torch.Tensor)]
    raise TypeError(
        f"broadcast_parameters takes an nn.Module or a state dict (a mapping of names to tensors), "
        f"not {type(model_or_state_dict).__name__}"
    )


def _check_root(root: int, group: Group | None) -> None:
    if root not in group_ranks(group):
        raise ValueError(f"root={root} is not a rank of the group {list(group_ranks(group))}")


def _broadcaster(root: int, group: Group | None) -> Callable[[torch.Tensor], None]:
    """Broadcast in place. The layout is agreed once beforehand, so the backend is called
    directly (no per-message argument check) unless the tensor needs staging."""
    backend = runtime.get_backend()
    timeout = runtime.state().timeout

    def send(flat: torch.Tensor) -> None:
        if backend.supports_device(flat.device):
            backend.broadcast(flat, root, group).wait(timeout)
        else:
            collectives.broadcast(flat, root=root, inplace=True, group=group)

    return send


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
    _check_root(root, group)
    named = [(name, t) for name, t in named if splits.kind_of(t) != splits.FULLY_SHARD]
    mixed = [name for name, t in named if splits.mixes_slices(t, group)]
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
    coalesced((t for _, t in named), _broadcaster(root, group), copy_back=not is_root)


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
    _check_root(root, group)
    if group_size(group) == 1 or not named:
        return
    agree_layout("broadcast_buffers", describe_tensors(named), group)
    coalesced((t for _, t in named), _broadcaster(root, group), copy_back=runtime.rank() != root)


# -- optimizer state ------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorSlot:
    """Stands in for a tensor in the pickled skeleton of root's optimizer state."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_accelerator: bool


def _hollow(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a `_TensorSlot` (the tensor goes to `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype,
                           value.device.type != "cpu")
    if isinstance(value, dict):
        return {k: _hollow(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_hollow(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_hollow(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, tensors) for v in value)
    return value


def _slots(value: Any, found: list[_TensorSlot]) -> list[_TensorSlot]:
    if isinstance(value, _TensorSlot):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _slots(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _slots(v, found)
    return found


def broadcast_optimizer_state(optimizer: Any, root: int = 0, group: Group | None = None) -> None:
    """Make every rank's optimizer state and hyper-parameters (lr, momentum, ...) equal root's.

    Works whether or not the optimizers have stepped: the other ranks load root's
    `state_dict()` (its hyper-parameters, and its state tensors when it has any). Unlike
    Horovod, no dummy step is taken to create state, so parameters are never touched (a dummy
    step would move them under weight decay). Root's state travels as a small pickled skeleton
    plus its tensors, packed into a few flat messages per dtype.

    `optimizer` is a torch optimizer or any wrapper with `state_dict()` / `load_state_dict()`
    (tandem's `DistributedOptimizer`, `LocalSGD`). A `ZeroOptimizer` needs no broadcast: its
    state is sharded, and to restore it every rank loads the full state dict (which `td.load`
    returns on every rank). Calling this on one is harmless (its `state_dict()` is collective
    and every rank takes part) and propagates root's hyper-parameters.

    Args:
        optimizer: a torch optimizer or a wrapper with `state_dict()` / `load_state_dict()`.
        root: the global rank whose state is copied.
        group: the ranks that receive it (None: the world).

    Raises:
        ValueError: `root` is not a rank of `group`, or a rank cannot load root's state (its
            optimizer holds other parameters or groups; the rank is named).
        TypeError: `optimizer` has no `state_dict()` and `load_state_dict()`.
    """
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "load_state_dict")):
        raise TypeError(
            f"broadcast_optimizer_state needs an optimizer with state_dict() and load_state_dict(), "
            f"got {type(optimizer).__name__}"
        )
    _check_root(root, group)
    if group_size(group) == 1:
        return
    is_root = runtime.rank() == root
    state = optimizer.state_dict()
    tensors: list[torch.Tensor] = []
    skeleton = _hollow(state, tensors) if is_root else None
    skeleton = collectives.broadcast_object(skeleton, root=root, group=group)
    if is_root:
        received = tensors
    else:
        device = runtime.device()
        received = [
            torch.empty(slot.shape, dtype=slot.dtype,
                        device=device if slot.on_accelerator else torch.device("cpu"))
            for slot in sorted(_slots(skeleton, []), key=lambda s: s.index)
        ]
    # Root's tensors are only read; the others receive in place into `received`.
    coalesced(received, _broadcaster(root, group), copy_back=not is_root)
    if not is_root:
        try:
            optimizer.load_state_dict(_fill(skeleton, received))
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"rank {runtime.rank()} could not load rank {root}'s optimizer state: {error}. "
                f"Build the optimizer over the same parameters, in the same groups, on every rank."
            ) from error


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
    def pieces(tensor: torch.Tensor) -> bool:
        return splits.kind_of(tensor) == splits.FULLY_SHARD or splits.mixes_slices(tensor, group)

    replicas.check_replicas(model, group, atol, buffers, skip=pieces)
