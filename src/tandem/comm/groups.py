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
    """A world laid out as `dp` replicas of a `pp`-stage pipeline whose stages are each split
    over `tp` ranks (tensor parallelism).

    Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank: the tensor-parallel ranks of one
    stage are neighbours (one node, where the most traffic is), then the stages of one
    pipeline. `tp_group` links the ranks that split this rank's layers; `pp_group` the stages of
    this rank's pipeline (same dp and tp position); `dp_group` the replicas of this rank's shard
    (same stage and tp position), over which gradients are averaged.
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Group
    pp_group: Group
    tp: int = 1
    tp_rank: int = 0
    tp_group: Group | None = None


def mesh(dp: int = 1, pp: int = 1, tp: int = 1) -> Mesh:
    """Split the world into `dp` × `pp` × `tp`. Every rank must call it, with the same sizes."""
    world = context.current().world
    if dp < 1 or pp < 1 or tp < 1:
        raise ValueError(f"mesh(dp={dp}, pp={pp}, tp={tp}): each must be >= 1")
    if dp * pp * tp != world.size:
        raise ValueError(
            f"mesh(dp={dp}, pp={pp}, tp={tp}) needs {dp * pp * tp} ranks, but the world has "
            f"{world.size}; start the job with -np {dp * pp * tp} or change the sizes"
        )
    position, tp_rank = divmod(world.rank, tp)
    dp_rank, pp_rank = divmod(position, pp)

    def rank_of(d: int, p: int, t: int) -> int:
        return (d * pp + p) * tp + t

    def mine(members: list[int]) -> Group | None:
        # Every rank creates every group (the engines require it), keeping its own.
        group = new_group(members)
        return group if world.rank in members else None

    dp_groups = [mine([rank_of(d, p, t) for d in range(dp)]) for p in range(pp) for t in range(tp)]
    pp_groups = [mine([rank_of(d, p, t) for p in range(pp)]) for d in range(dp) for t in range(tp)]
    tp_groups = [mine([rank_of(d, p, t) for t in range(tp)]) for d in range(dp) for p in range(pp)]

    def own(groups: list[Group | None]) -> Group:
        return next(g for g in groups if g is not None)

    return Mesh(dp, pp, dp_rank, pp_rank, own(dp_groups), own(pp_groups), tp, tp_rank,
                own(tp_groups))
