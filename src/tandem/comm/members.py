"""Who is in a group (None: the world): its size, this process's index in it, its ranks.

Below `groups`, which creates groups and has their creation agreed: the agreement primitive
and the exchanges it uses ask these questions, so they must not import group creation.
"""

from __future__ import annotations

from tandem.comm import context
from tandem.comm.engines.backend import Group


def group_size(group: Group | None, engine: context.Context | None = None) -> int:
    """`engine`: the context to read the world from (default: `td.init`'s)."""
    return (engine or context.current()).world.size if group is None else group.size


def group_rank(group: Group | None) -> int:
    return context.current().world.rank if group is None else group.rank


def group_ranks(group: Group | None, engine: context.Context | None = None) -> tuple[int, ...]:
    if group is not None:
        return group.ranks
    return tuple(range((engine or context.current()).world.size))
