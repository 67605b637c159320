"""Sub-groups of ranks, and the named 2-D layout (`mesh`) hybrid jobs use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.comm import context
from tandem.comm.backend import Group as Group  # where it is defined; imported from here too


def new_group(ranks: Sequence[int]) -> Group:
    """A group of the given global ranks. Every rank of the world must call it, in the same order."""
    engine = context.current()
    world = engine.world
    members = tuple(int(r) for r in ranks)
    if not members:
        raise ValueError("new_group needs at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group got a rank twice: {list(members)}")
    outside = [r for r in members if not 0 <= r < world.size]
    if outside:
        raise ValueError(f"ranks {outside} are outside the world of size {world.size}")
    handle = engine.backend.new_group(members)
    my_index = members.index(world.rank) if world.rank in members else -1
    return Group(members, handle, my_index)


def group_size(group: Group | None) -> int:
    return context.current().world.size if group is None else group.size


def group_rank(group: Group | None) -> int:
    return context.current().world.rank if group is None else group.rank


def group_ranks(group: Group | None) -> tuple[int, ...]:
    return tuple(range(context.current().world.size)) if group is None else group.ranks


@dataclass(frozen=True)
class Mesh:
    """A world laid out as `dp` replicas of a `pp`-stage pipeline.

    Global rank = dp_rank * pp + pp_rank, so the stages of one pipeline are neighbouring ranks
    (on one node when they fit). `pp_group` links the stages of this rank's pipeline;
    `dp_group` links the replicas of this rank's stage.
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Group
    pp_group: Group


def mesh(dp: int = 1, pp: int = 1) -> Mesh:
    """Split the world into `dp` × `pp`. Every rank must call it."""
    world = context.current().world
    if dp < 1 or pp < 1:
        raise ValueError(f"mesh(dp={dp}, pp={pp}): both must be >= 1")
    if dp * pp != world.size:
        raise ValueError(
            f"mesh(dp={dp}, pp={pp}) needs {dp * pp} ranks, but the world has {world.size}; "
            f"start the job with -np {dp * pp} or change dp/pp"
        )
    dp_rank, pp_rank = divmod(world.rank, pp)
    my_dp_group = my_pp_group = None
    # Every rank creates every group (the engines require it), keeping its own.
    for stage in range(pp):
        group = new_group([replica * pp + stage for replica in range(dp)])
        if stage == pp_rank:
            my_dp_group = group
    for replica in range(dp):
        group = new_group([replica * pp + stage for stage in range(pp)])
        if replica == dp_rank:
            my_pp_group = group
    return Mesh(dp, pp, dp_rank, pp_rank, my_dp_group, my_pp_group)
