"""Sharded state across a change of world: each rank's part, cut for the new world.

`td.elastic.State` with a `td.ZeroOptimizer`, or with a model `td.fully_shard`ed over the
world (and its optimizer), keeps only this rank's part in a commit (`parts`). After a change of
world the parts of the newest commit, the ranks' own and the peer backups of ranks that left,
are checked for holes (a small all-gather of the ranges they hold); then every rank sends each
rank just the pieces of its parts that the receiver's new cut holds (`cut`, one all-to-all of
raw bytes, `transfer`) and loads what it received (`load`). With holes, the checkpointer's
newest checkpoint is the fallback, or an error names what was lost.
"""

from __future__ import annotations

import warnings
from typing import Any

from tandem import runtime
from tandem.comm.collectives import user as collectives
from tandem.elastic import transfer
from tandem.parallel.fully_shard import resize
from tandem.parallel.layout.owner import owner_of
from tandem.rendezvous import elastic_rounds


def reshard(state, newest: int) -> bool:
    """The sharded parts of commit `newest` (ZeroOptimizer's; a fully sharded model's and
    its optimizer's), from the ranks that hold them, cut for this world; True when they
    cover the whole state. Else, every rank goes on from the checkpointer's newest
    checkpoint (resharded on load) and this returns False; without one, an error names
    what was lost. Collective."""
    own = [parts(state, state._snapshot)] if state._commits == newest else []
    backup = []  # the previous rank's part, when its owner left the job
    if state._backup is not None and state._backup[0] == newest and state._backup[1]:
        if state._backup[1]["worker"] not in round_workers(state):
            backup.append(state._backup[1])
    held = [where for every in collectives.allgather_object(
        [ranges(state, part) for part in own + backup]) for where in every]
    if state._fsdp:
        holes = resize.lost(held, state.model)
        lost = "state of fully_shard's " + ", ".join(holes)
    else:
        holes = owner_of(state.optimizer).holes([r for where in held for r in where])
        lost = f"{owner_of(state.optimizer).kind} state of flat elements " + ", ".join(holes)
    if not holes:  # each rank gets the pieces of every part that its new cut holds
        outgoing = [[cut(state, part, rank) for part in own + backup]
                    for rank in range(runtime.size())]
        load(state, [part for sent in transfer.alltoall(outgoing) for part in sent])
        return True
    if state.checkpointer is None:
        raise RuntimeError(
            f"td.elastic: the {lost} was held only by the rank(s) that left, so no rank "
            f"can send it. Give td.elastic.State(..., peer_backup=True) (each rank also "
            f"keeps the previous rank's part: one lost rank is restored from memory) or "
            f"a disk fallback, checkpointer=td.Checkpointer(dir, every=N) (the job goes "
            f"on from its last checkpoint)")
    if runtime.rank() == 0:
        warnings.warn(f"td.elastic: the {lost} left with the lost rank(s): going on from "
                      f"the checkpointer's newest checkpoint", stacklevel=3)
    state._from_checkpoint()
    state._snapshot = state._take()
    state._commits = newest
    return False


def parts(state, snapshot: dict[str, Any]) -> dict[str, Any]:
    """The sharded parts of a snapshot: what the other ranks need after a change."""
    job = runtime.state().job
    return {"model": snapshot.get("model") if state._fsdp else None,
            "optimizer": snapshot.get("optimizer") if state._sharded else None,
            "worker": job.elastic.worker if job.elastic is not None else runtime.rank()}


def ranges(state, part: dict[str, Any]) -> Any:
    """What a part holds: each unit's flat range, or ZeroOptimizer's ranges."""
    return (resize.ranges(part["model"]) if state._fsdp
            else [tuple(r) for r in part["optimizer"]["ranges"]])


def cut(state, part: dict[str, Any], rank: int) -> dict[str, Any]:
    """What `rank` needs of `part` in the current cut."""
    if state._fsdp:
        return {**resize.cut(part, state.model, rank), "worker": part["worker"]}
    return {**part, "optimizer": owner_of(state.optimizer).cut_for(part["optimizer"], rank)}


def round_workers(state) -> set[int]:
    """The workers of this process's round (every rank, outside an elastic job)."""
    job = runtime.state().job
    if job.elastic is None:
        return set(range(runtime.size()))
    state._look()
    return set(elastic_rounds.read(state._store, job.elastic.round).workers)


def load(state, parts: list[dict[str, Any]]) -> None:
    """This rank's part, in its current cut, of the sharded state in `parts`."""
    optimizers = [part["optimizer"] for part in parts]
    if owner_of(state.optimizer).sharded_over_world():
        owner_of(state.optimizer).load_shards(optimizers)
    if state._fsdp:
        resize.load_model_state(state.model, [part["model"] for part in parts])
        if state.optimizer is not None:
            resize.load_optimizer_shards(state.optimizer, state.model, optimizers)
