"""Sub-groups of ranks, and the named 2-D layout (`mesh`) hybrid jobs use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem import runtime


@dataclass(frozen=True, eq=False)
class Group:
    """An ordered set of global ranks that communicate together.

    `rank` is this process's index in the group (-1 when it is not a member). Roots, sources
    and destinations passed to collectives stay *global* ranks, as in torch.distributed.
    """

    ranks: tuple[int, ...]
    handle: object
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks

    def index(self, global_rank: int) -> int:
        """The group rank of a global rank."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in the group {list(self.ranks)}") from None

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)})"


def new_group(ranks: Sequence[int]) -> Group:
    """A group of the given global ranks. Every rank of the world must call it, in the same order."""
    world = runtime.world()
    members = tuple(int(r) for r in ranks)
    if not members:
        raise ValueError("new_group needs at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group got a rank twice: {list(members)}")
    outside = [r for r in members if not 0 <= r < world.size]
    if outside:
        raise ValueError(f"ranks {outside} are outside the world of size {world.size}")
    handle = runtime.get_backend().new_group(members)
    my_index = members.index(world.rank) if world.rank in members else -1
    return Group(members, handle, my_index)


def group_size(group: Group | None) -> int:
    return runtime.size() if group is None else group.size


def group_rank(group: Group | None) -> int:
    return runtime.rank() if group is None else group.rank


def group_ranks(group: Group | None) -> tuple[int, ...]:
    return tuple(range(runtime.size())) if group is None else group.ranks


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
    world = runtime.world()
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
