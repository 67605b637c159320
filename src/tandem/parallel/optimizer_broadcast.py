"""Make replicas' optimizer state start equal: `td.broadcast_optimizer_state` (re-exported by
`parallel/broadcast.py`, which copies the model's tensors), and the root check and in-place
broadcaster both use. Its own file because the owners (`parallel/layout/owner.py`) copy optimizer
state with it, and the model side asks the owners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.collectives.tensors import coalesced
from tandem.comm.groups import Group, group_ranks, group_size


def check_root(root: int, group: Group | None) -> None:
    if root not in group_ranks(group):
        raise ValueError(f"root={root} is not a rank of the group {list(group_ranks(group))}")


def broadcaster(root: int, group: Group | None) -> Callable[[torch.Tensor], None]:
    """Broadcast in place. The layout is agreed once beforehand, so the backend is called
    directly (no per-message argument check) unless the tensor needs staging."""
    backend = runtime.get_backend()
    timeout = runtime.state().timeout

    def send(flat: torch.Tensor) -> None:
        if backend.supports_device(flat.device):
            direct.broadcast_into(flat, root, group)[0].wait(timeout)
        else:
            collectives.broadcast(flat, root=root, inplace=True, group=group)

    return send


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
    check_root(root, group)
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
    coalesced(received, broadcaster(root, group), copy_back=not is_root)
    if not is_root:
        try:
            optimizer.load_state_dict(_fill(skeleton, received))
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"rank {runtime.rank()} could not load rank {root}'s optimizer state: {error}. "
                f"Build the optimizer over the same parameters, in the same groups, on every rank."
            ) from error


__all__ = ["broadcast_optimizer_state", "broadcaster", "check_root"]
