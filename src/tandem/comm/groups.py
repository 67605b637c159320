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
    """A world laid out as `dp` replicas of a `pp`-stage pipeline whose stages are `tp` wide.

    Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so the tensor-parallel ranks of one
    stage are neighbours (they talk most), then the stages of one pipeline. `tp_group` links the
    ranks sharing this rank's layers; `pp_group` the stages of its pipeline (same tp_rank);
    `dp_group` the replicas of its shard (same pp_rank and tp_rank): gradients average over it.
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
    """Split the world into `dp` × `pp` × `tp`. Every rank must call it."""
    world = context.current().world
    call = f"mesh(dp={dp}, pp={pp}{f', tp={tp}' if tp != 1 else ''})"
    if dp < 1 or pp < 1 or tp < 1:
        raise ValueError(f"{call}: each of dp, pp, tp must be >= 1")
    if dp * pp * tp != world.size:
        raise ValueError(
            f"{call} needs {dp * pp * tp} ranks, but the world has "
            f"{world.size}; start the job with -np {dp * pp * tp} or change dp/pp/tp"
        )
    rest, tp_rank = divmod(world.rank, tp)
    dp_rank, pp_rank = divmod(rest, pp)

    coords = [(r // tp // pp, r // tp % pp, r % tp) for r in range(world.size)]
    mine = {}
    # Every rank creates every group in the same order (the engines require it), keeping its own.
    # A group varies one coordinate: its members share the other two.
    for axis, kind in enumerate(("dp", "pp", "tp")):
        others = {}
        for r, c in enumerate(coords):
            others.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        for members in others.values():
            group = new_group(members)
            if world.rank in members:
                mine[kind] = group
    return Mesh(dp, pp, dp_rank, pp_rank, mine["dp"], mine["pp"], tp, tp_rank, mine["tp"])
