"""Branches of one model on different ranks, run at the same time on the same batch.

`Branches([a, b, c], join="cat", group=g)`: rank i of `g` holds and runs the branches
`i, i + n, i + 2n, ...` (n = group size) on the replicated input; the outputs are joined
differentiably — summed (`join="sum"`) or concatenated along the last dim (`join="cat"`, in
branch order). Every rank then holds the joined output, as the one-process model would, and the
loss computed after it is replicated, so the joins are the tensor-parallel regions (forward
all-reduce / backward identity; forward all-gather / backward slice) rather than
`tandem.functional`'s sum-over-ranks convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tandem.comm.groups import Group, group_rank, group_size
from tandem.parallel.tensor import regions

JOINS = ("sum", "cat")


class Branches(nn.Module):
    """Place `branches` on the ranks of `group` (round robin) and join their outputs."""

    def __init__(self, branches: Sequence[nn.Module], join: str = "cat", group: Group | None = None) -> None:
        super().__init__()
        if join not in JOINS:
            raise ValueError(f"Branches: join={join!r}; use one of {JOINS}")
        n = group_size(group)
        if group is not None and group.rank < 0:
            raise ValueError(f"Branches: this rank is not a member of {group!r}; build it on members only")
        if len(branches) % n:
            raise ValueError(
                f"Branches: {len(branches)} branches cannot be shared equally by a group of {n} ranks; "
                f"use a group whose size divides {len(branches)}, or add/merge branches")
        me = group_rank(group)
        self.join, self.group, self.count = join, group, len(branches)
        self.local = nn.ModuleList(branches[me::n])
        self.indices = list(range(me, len(branches), n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = regions.copy_to_group(x, self.group)
        outputs = [branch(x) for branch in self.local]
        if self.join == "sum":
            return regions.reduce_from_group(torch.stack(outputs).sum(0), self.group)
        # Ranks hold branches i, i+n, ...: gather per round, then order by branch index.
        n = group_size(self.group)
        rounds = [regions.gather_from_group(out, self.group) for out in outputs]
        width = outputs[0].shape[-1]
        pieces = [r.split(width, dim=-1) for r in rounds]  # pieces[round][rank]
        ordered = [pieces[i // n][i % n] for i in range(self.count)]
        return torch.cat(ordered, dim=-1)
