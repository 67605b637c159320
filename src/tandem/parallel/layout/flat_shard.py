"""One flat space cut into equal shards: the arithmetic ZeroOptimizer and fully_shard share.

Tensors laid end to end make a flat space of `numel` elements; it is padded to a multiple of
the group size and cut into `size` shards of `shard_numel` elements, rank r holding
[r * shard_numel, (r + 1) * shard_numel). The padding lives only at the end of the last
shards; `my_range` is the part of this rank's shard that holds real elements, and
`placements` says which boxes of which one-process tensors those are (`parallel/layout/pieces.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.parallel.layout.pieces import Placement, flat_placements


@dataclass(frozen=True)
class FlatShard:
    numel: int
    size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.size)

    @property
    def padded_numel(self) -> int:
        return self.size * self.shard_numel

    @property
    def start(self) -> int:
        """First element of this rank's shard in the flat space (padding included)."""
        return self.rank * self.shard_numel

    def my_range(self) -> tuple[int, int]:
        """[lo, hi) of this rank's shard, clipped to the real (unpadded) elements."""
        lo = min(self.start, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)

    def placements(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                   lo: int | None = None, hi: int | None = None, base: int = 0) -> tuple[Placement, ...]:
        """The one-process pieces in [lo, hi) of the flat space (default: this rank's range), the
        tensors `names` lying end to end from element `base`."""
        mine = self.my_range()
        return flat_placements(names, shapes, mine[0] if lo is None else lo,
                               mine[1] if hi is None else hi, base)

