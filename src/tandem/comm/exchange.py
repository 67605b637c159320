"""Raw exchanges under the collectives: every rank's length, every rank's picklable object.

No argument check runs here: these are what the checks themselves (and the agreement's slow
path, see `agreement`) use to show every rank's version, and what `allgather`/
`allgather_object` build on after their own check.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from tandem.comm import context
from tandem.comm.backend import Group
from tandem.comm.groups import group_size


def lengths(length: int, group: Group | None, engine: context.Context) -> list[int]:
    """Every rank's `length` (one int64 each), in group order."""
    mine = context.on_wire(torch.tensor([length], dtype=torch.int64), engine)
    everyone = torch.zeros(group_size(group), dtype=torch.int64, device=mine.device)
    engine.backend.allgather_into(everyone, mine, group).wait(engine.timeout)
    return everyone.tolist()


def pickled(obj: Any) -> torch.Tensor:
    """`obj` as a uint8 tensor of its pickle."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def objects(payload: torch.Tensor, group: Group | None, engine: context.Context) -> list[Any]:
    """Every rank's `pickled(...)` payload, unpickled, in group order (two messages)."""
    sizes = lengths(payload.numel(), group, engine)
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    source = context.on_wire(padded, engine)
    output = torch.empty(len(sizes) * longest, dtype=torch.uint8, device=source.device)
    engine.backend.allgather_into(output, source, group).wait(engine.timeout)
    gathered = output.cpu().numpy()
    return [pickle.loads(gathered[i * longest : i * longest + n].tobytes())
            for i, n in enumerate(sizes)]
