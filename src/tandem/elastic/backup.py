"""Each rank's part of a sharded commit, also held by the next rank (`State(peer_backup=True)`).

A ZeroOptimizer's or a fully sharded model's state exists once, split over the ranks: a rank
that dies takes its part with it. With a peer backup, every commit also sends this rank's part
to rank r + 1 (mod N), which keeps it beside its own, so one lost rank (or several, none next to
another) is restored from memory. The price, per commit: one message of 1/N of the sharded
state to one peer (an all-to-all where each rank sends to one rank only), and that much more
host memory per rank.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from tandem import runtime
from tandem.comm import collectives


def exchange(part: Any) -> Any:
    """Send `part` to the next rank; return the previous rank's. Collective."""
    size, rank = runtime.size(), runtime.rank()
    if size == 1:
        return None
    payload = torch.frombuffer(bytearray(pickle.dumps(part)), dtype=torch.uint8)
    splits = [0] * size
    splits[(rank + 1) % size] = payload.numel()
    received = collectives.alltoall(payload, splits)
    return pickle.loads(received.numpy().tobytes())
