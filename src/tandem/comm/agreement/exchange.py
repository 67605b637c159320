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
from tandem.comm.engines.backend import Group, on_wire
from tandem.comm.members import group_size

_MAX_OBJECT = 1 << 34  # 16 GiB: more is another operation's data read as a length


def lengths(length: int, group: Group | None, engine: context.Context) -> list[int]:
    """Every rank's `length` (one int64 each), in group order."""
    mine = on_wire(torch.tensor([length], dtype=torch.int64), engine.backend)
    everyone = torch.zeros(group_size(group, engine), dtype=torch.int64, device=mine.device)
    engine.backend.allgather_into(everyone, mine, group).wait(engine.timeout)
    return everyone.tolist()


def pickled(obj: Any) -> torch.Tensor:
    """`obj` as a uint8 tensor of its pickle."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def objects(payload: torch.Tensor, group: Group | None, engine: context.Context) -> list[Any]:
    """Every rank's `pickled(...)` payload, unpickled, in group order (two messages)."""
    sizes = lengths(payload.numel(), group, engine)
    if min(sizes) < 0 or max(sizes) > _MAX_OBJECT:
        # Only when the ranks' code paths diverged: another operation's message was read here.
        raise RuntimeError(
            f"rank {engine.world.rank}: received object lengths {sizes} that no rank sent; the "
            "ranks are in different operations (their code paths diverged)")
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    source = on_wire(padded, engine.backend)
    output = torch.empty(len(sizes) * longest, dtype=torch.uint8, device=source.device)
    engine.backend.allgather_into(output, source, group).wait(engine.timeout)
    gathered = output.cpu().numpy()
    try:
        return [pickle.loads(gathered[i * longest : i * longest + n].tobytes())
                for i, n in enumerate(sizes)]
    except Exception as error:  # noqa: BLE001 - bytes from another operation, not an object
        raise RuntimeError(
            f"rank {engine.world.rank}: received bytes that are not a pickled object "
            f"({type(error).__name__}: {error}); the ranks are in different operations (their "
            "code paths diverged)") from None
