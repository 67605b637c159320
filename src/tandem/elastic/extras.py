"""The extras of a `td.elastic.State`, kept by value.

An extra is either a plain value (`step=0`, `epoch=3`, a dict of counters), copied into each
snapshot, or a *stateful object*: anything with `state_dict()` and `load_state_dict()` (a
learning-rate scheduler, a sampler, a `GradScaler`, your own). A stateful object is never
copied: a copy of a scheduler holds a copy of its optimizer, so the copy would step an
optimizer the training loop does not use and the real learning rate would never change.
Its snapshot is its state dict; a restore loads that into the same object, in place; ranks
compare and exchange its state dict, never its identity.

A data loader is a stateful object when it keeps its position (`td.partition_dataset`'s: its
epoch and place in the epoch's order; after a change of world the rest of the epoch is split
over the new ranks). One without (a plain `DataLoader`) is warned about once and left out of
the snapshots: it restarts at its epoch's start, as it would anyway.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from tandem.data import keeps_position

_WHERE = "td.elastic.State's commits"


def is_stateful(value: Any) -> bool:
    """Whether `value` is kept by its state dict (it has `state_dict` and `load_state_dict`)."""
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def check(name: str, value: Any) -> None:
    """Refuse an extra that can be neither copied by value nor kept by its state dict."""
    if not keeps_position(name, value, _WHERE):
        return  # warned: left out of the snapshots
    if isinstance(value, type):
        raise TypeError(f"td.elastic.State: extra {name!r} is a class ({value.__name__}); give an "
                        f"instance, or keep it outside the State")
    try:
        pickle.dumps(value.state_dict() if is_stateful(value) else value)
    except Exception as error:  # pickle raises many kinds (TypeError, AttributeError, ...)
        how = ("its state_dict() cannot be pickled" if is_stateful(value)
               else "it cannot be pickled and has no state_dict()/load_state_dict()")
        raise TypeError(
            f"td.elastic.State: extra {name!r} ({type(value).__name__}) cannot be kept: {how} "
            f"({type(error).__name__}: {error}). The State copies each extra into every commit "
            f"and sends it to ranks that join: keep plain values (numbers, strings, lists, "
            f"dicts, tensors), or objects with state_dict()/load_state_dict() (schedulers, "
            f"samplers, GradScaler), or give your object those two methods") from None


def values(extras: dict[str, Any]) -> dict[str, Any]:
    """A copy of the extras by value: each stateful object's state dict, each other value."""
    return {name: copy.deepcopy(value.state_dict() if is_stateful(value) else value)
            for name, value in extras.items() if keeps_position(name, value, _WHERE)}


def load(extras: dict[str, Any], saved: dict[str, Any]) -> None:
    """Put `saved` (from `values`) back: into each stateful object in place, the other values
    as copies. An extra the snapshot does not hold is left as it is."""
    for name, value in saved.items():
        current = extras.get(name)
        if is_stateful(current):
            current.load_state_dict(copy.deepcopy(value))
        else:
            extras[name] = copy.deepcopy(value)


def digest_bytes(extras: dict[str, Any]) -> bytes:
    """The extras by value, as bytes every replica must have alike."""
    return pickle.dumps(sorted(values(extras).items(), key=str))
