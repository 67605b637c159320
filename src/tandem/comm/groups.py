"""Sub-groups of ranks, and the named 3-D layout (`mesh`) hybrid jobs use.

Creating a group is collective over the whole world, on every engine: every rank calls
`new_group` (or `mesh`) with the same arguments, in the same order, members or not. Ranks
that do not (one builds `mesh(dp=2)` where another builds `mesh(tp=2)`) would leave the
engine waiting inside its own group set-up, outside the watchdog: torch's `dist.new_group`
waits on its store for ranks that create another group. So the ranks first agree on the call,
with the one agreement primitive (`agreement.agree`: one message of the standard size on the
world, a watched all-reduce): a difference is a `GroupMismatchError` on every rank within
seconds, naming each rank's call; a rank that never gets there is named by the watchdog
(its timeout, or a desync it can prove), never a hang. Only then does the engine create the
group. One agreement per `mesh`, not per group: equal sizes make equal groups.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.comm import context
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import fingerprints
from tandem.comm.engines.backend import Group  # where it is defined; imported from here too

# The queries on a group are public from here; they live in `members`, below the agreement.
from tandem.comm.members import group_rank as group_rank
from tandem.comm.members import group_ranks as group_ranks
from tandem.comm.members import group_size as group_size


class GroupMismatchError(agreement.CollectiveMismatchError):
    """Ranks created groups differently: other `new_group` ranks or other `mesh` sizes."""


_ADVICE = (
    "Every rank must make the same td.new_group / td.mesh calls, with the same arguments and "
    "in the same order, members of the group or not (the engines create a group on the whole "
    "world together). Compute the sizes once, from the same configuration on every rank "
    "(not from the rank), and create every group before branching on the rank.")


def _explain(ranks: tuple[int, ...], calls: list[str]) -> str:
    lines = "\n".join(f"  rank {r}: {call}" for r, call in zip(ranks, calls, strict=True))
    return (f"td.new_group / td.mesh: the ranks created different groups (nothing was "
            f"created):\n{lines}\n{_ADVICE}")


def agree_on(call: str, engine: context.Context) -> None:
    """Raise `GroupMismatchError` on every rank unless every rank of the world makes `call`.

    Always on (checks or not): creating a group is rare, and this is what stands between a
    mismatch and a hang inside the engine. The call site is shown, not compared: code that
    branches on the rank may create one group from two lines.
    """
    agreement.agree(f"{call} at {fingerprints.call_site()}", None, explain=_explain,
                    codes=[agreement.checksum(call)], error=GroupMismatchError, engine=engine)


def _members(ranks: Sequence[int]) -> tuple[tuple[int, ...] | None, str]:
    """The ranks as ints and the call as text; None when they are not a sequence of ints
    (the error is raised after the agreement, so that the other ranks do not wait for it)."""
    try:
        members = tuple(operator.index(r) for r in ranks)
    except (TypeError, ValueError):
        return None, f"td.new_group({ranks!r})"
    return members, f"td.new_group({list(members)})"


def new_group(ranks: Sequence[int]) -> Group:
    """A group of the given global ranks, in that order.

    Every rank of the world must call it, with the same ranks, in the same order of calls,
    members or not; ranks that pass other ranks get a `GroupMismatchError` (every rank, the
    same message) instead of a hang.

    Args:
        ranks: the global ranks of the group; its first is group rank 0.

    Returns:
        The `Group`; on a rank outside it, a `Group` whose `rank` is -1 (it cannot be used there).

    Raises:
        GroupMismatchError: the ranks passed other ranks, or made other group calls before this
            one (every rank gets it, each rank's call named).
        ValueError: no rank, a rank given twice, or a rank outside the world.
        TypeError: `ranks` is not a sequence of ints.
    """
    engine = context.current()
    members, call = _members(ranks)
    agree_on(call, engine)
    if members is None:
        raise TypeError(f"{call}: ranks must be a sequence of ints (global ranks)")
    return _create(members, engine)


def _create(members: tuple[int, ...], engine: context.Context) -> Group:
    """The engine's group of `members` (every rank of the world calls it, already agreed)."""
    world = engine.world
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


@dataclass(frozen=True)
class Mesh:
    """A world laid out as `dp` replicas of a `pp`-stage pipeline whose stages are each split
    over `tp` ranks (tensor parallelism), and, with `shard` > 1, fully sharded over `shard`
    ranks within each replica (HSDP: `td.fully_shard(block, mesh=mesh)`).

    Global rank = ((dp_rank * pp + pp_rank) * shard + shard_rank) * tp + tp_rank: the
    tensor-parallel ranks of one stage are neighbours (one node, where the most traffic is),
    then the ranks that shard it, then the stages of one pipeline. `tp_group` links the ranks
    that split this rank's layers; `shard_group` those that share this replica's shards (None
    when `shard` is 1); `pp_group` the stages of this rank's pipeline (same dp, shard and tp
    position); `dp_group` the replicas of this rank's shard (same stage, shard and tp
    position), over which gradients are averaged.

    With `cp` > 1 each replica's sequences are split over `cp` ranks (context parallelism,
    `td.context`), between the shard and tp positions: global rank = (((dp_rank * pp + pp_rank)
    * shard + shard_rank) * cp + cp_rank) * tp + tp_rank. `cp_group` links the ranks that share
    this rank's sequences (a group of this rank alone when `cp` is 1: never the world);
    `dp_group` then holds the same cp position, and `dp_cp_group` the ranks of every dp and cp
    position (same stage, shard and tp position), over which a sequence-split model's gradients
    are averaged (it is `dp_group` when `cp` is 1).

    Made by `td.mesh`, not by users; every field is one of its attributes.

    Args:
        dp: the number of replicas.
        pp: the number of pipeline stages.
        dp_rank: this rank's replica.
        pp_rank: this rank's stage.
        dp_group: the replicas of this rank's shard, over which gradients are averaged.
        pp_group: the stages of this rank's pipeline.
        tp: the number of tensor-parallel ranks.
        tp_rank: this rank's position among them.
        tp_group: the ranks that split this rank's layers.
        shard: the number of ranks each replica is sharded over.
        shard_rank: this rank's position among them.
        shard_group: the ranks that share this replica's shards (None when `shard` is 1).
        cp: the number of context-parallel ranks.
        cp_rank: this rank's position among them.
        cp_group: the ranks that share this rank's sequences.
        dp_cp_group: the ranks of every dp and cp position (same stage, shard and tp position).
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
    shard: int = 1
    shard_rank: int = 0
    shard_group: Group | None = None
    cp: int = 1
    cp_rank: int = 0
    cp_group: Group | None = None
    dp_cp_group: Group | None = None


def mesh(dp: int = 1, pp: int = 1, tp: int = 1, shard: int = 1, cp: int = 1) -> Mesh:
    """Split the world into `dp` × `pp` × `shard` × `cp` × `tp`.

    Every rank must call it with the same sizes (and make the same `new_group` calls before
    it); ranks that pass other sizes get a `GroupMismatchError` naming each rank's call, on
    every rank, instead of a hang. Sizes that do not fit the world are a `ValueError`.

    Args:
        dp: the number of replicas (data parallelism).
        pp: the number of pipeline stages.
        tp: the number of ranks each stage's layers are split over (tensor parallelism).
        shard: the number of ranks each replica is fully sharded over (HSDP).
        cp: the number of ranks each replica's sequences are split over (context parallelism).

    Returns:
        This rank's `Mesh`: its position along each size and its groups.

    Raises:
        GroupMismatchError: the ranks passed other sizes, or made other group calls before this
            one (every rank gets it, each rank's call named).
        ValueError: a size below 1, or sizes whose product is not the world size (the message
            says the -np to start with).
    """
    engine = context.current()
    world = engine.world
    # Agreed before the sizes are checked: a rank whose sizes are wrong alone is named as the
    # odd one out, where raising on it alone would leave the others waiting for it.
    sizes = f"dp={dp!r}, pp={pp!r}, tp={tp!r}" + (f", shard={shard!r}" if shard != 1 else "")
    sizes += f", cp={cp!r}" if cp != 1 else ""
    agree_on(f"td.mesh({sizes})", engine)
    if dp < 1 or pp < 1 or tp < 1 or shard < 1 or cp < 1:
        raise ValueError(f"mesh({sizes}): each must be >= 1")
    needed = dp * pp * tp * shard * cp
    if needed != world.size:
        raise ValueError(
            f"mesh({sizes}) needs {needed} ranks, but the world has "
            f"{world.size}; start the job with -np {needed} or change the sizes"
        )
    position, tp_rank = divmod(world.rank, tp)
    position, cp_rank = divmod(position, cp)
    position, shard_rank = divmod(position, shard)
    dp_rank, pp_rank = divmod(position, pp)

    def rank_of(d: int, p: int, t: int, s: int = 0, c: int = 0) -> int:
        return (((d * pp + p) * shard + s) * cp + c) * tp + t

    def mine(members: list[int]) -> Group | None:
        # Every rank creates every group (the engines require it), keeping its own.
        group = _create(tuple(members), engine)
        return group if world.rank in members else None

    dp_groups, pp_groups, tp_groups = [], [], []
    # with shard == cp == 1, the groups (and their order) of a dp x pp x tp mesh
    for s, c in ((s, c) for s in range(shard) for c in range(cp)):
        dp_groups += [mine([rank_of(d, p, t, s, c) for d in range(dp)]) for p in range(pp) for t in range(tp)]
        pp_groups += [mine([rank_of(d, p, t, s, c) for p in range(pp)]) for d in range(dp) for t in range(tp)]
        tp_groups += [mine([rank_of(d, p, t, s, c) for t in range(tp)]) for d in range(dp) for p in range(pp)]
    shard_groups = [mine([rank_of(d, p, t, s, c) for s in range(shard)]) for c in range(cp)
                    for d in range(dp) for p in range(pp) for t in range(tp)] if shard > 1 else []
    cp_groups = [mine([rank_of(d, p, t, s, c) for c in range(cp)]) for s in range(shard)
                 for d in range(dp) for p in range(pp) for t in range(tp)] if cp > 1 else []
    dp_cp_groups = [mine([rank_of(d, p, t, s, c) for d in range(dp) for c in range(cp)])
                    for s in range(shard) for p in range(pp) for t in range(tp)] if cp > 1 else []

    def own(groups: list[Group | None]) -> Group:
        return next(g for g in groups if g is not None)

    dp_group = own(dp_groups)
    # cp == 1: a group of this rank alone, made without the engine (a sequence split over it
    # is no split; None would mean the world)
    cp_group = own(cp_groups) if cp > 1 else Group((world.rank,), None, 0)
    return Mesh(dp, pp, dp_rank, pp_rank, dp_group, own(pp_groups), tp, tp_rank,
                own(tp_groups), shard, shard_rank, own(shard_groups) if shard > 1 else None,
                cp, cp_rank, cp_group, own(dp_cp_groups) if cp > 1 else dp_group)
