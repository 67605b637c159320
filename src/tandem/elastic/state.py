"""`td.elastic.State`: what an elastic job keeps across a change of world, held in memory.

    state = td.elastic.State(model=model, optimizer=opt, step=0)
    ...
    state.step += 1
    state.commit()          # a snapshot in memory; then: did the world change?

`commit()` copies the model's and the optimizer's state dicts and the extras (attributes
given as keywords: plain values such as `state.step`, `state.epoch`, copied; objects with
`state_dict()`/`load_state_dict()` such as a scheduler, kept by their state dict and restored
in place, see `extras`) into this process's memory: a
`clone()` of each tensor, no disk, no communication beyond one small message. That message
(`_agree`) does two things for every rank at once: it says whether the launcher formed a new
round (ranks joined: `WorldChanged` is raised after the snapshot, so nothing is lost), and it
compares what each rank committed (how many commits, the extras, a checksum of the model) so
that ranks that drifted apart are named, not averaged.

After a change, `sync()` (called by `td.elastic.run`) puts every rank back on the newest
commit any of them holds: each rank rolls back to its own snapshot, and the rank with the
most commits sends its snapshot to the others (a survivor sends it to newcomers; no file is
read). Only when no rank holds a snapshot (a job that never committed, or restarted as a whole)
does the state come from the `checkpointer` given, if any (`td.Checkpointer`, the fallback).
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tandem import runtime
from tandem.comm.collectives import user as collectives
from tandem.elastic import extras as kept
from tandem.elastic import transfer
from tandem.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters
from tandem.parallel.fully_shard import resize
from tandem.parallel.layout import splits, state_pieces
from tandem.parallel.layout.owner import owner_of
from tandem.rendezvous import elastic_rounds
from tandem.rendezvous.client import StoreClient


class WorldChanged(RuntimeError):
    """The launcher formed a new round (workers joined or left); raised by `State.commit()`
    once the commit is safe, and handled by `td.elastic.run`."""


class StateMismatchError(RuntimeError):
    """Ranks committed different states (other extras, another model, a skipped commit)."""


_OWN = ("model", "optimizer", "checkpointer")


class State:
    """The model, the optimizer and any extras that `td.elastic.run` restores after a change
    of world. Extras are attributes: `State(model=m, optimizer=o, epoch=0)` then `state.epoch`.

    Args:
        model: the replicated model (or one td.fully_shard shards over the world).
        optimizer: its optimizer (`td.DistributedOptimizer`, a torch optimizer of a
            `DistributedDataParallel` model, or a `td.ZeroOptimizer` over the world).
        checkpointer: a `td.Checkpointer` that each commit also saves to (on disk every
            `every` commits): the fallback when no rank holds the last commit.
        peer_backup: with sharded state, each commit also hands this rank's part to the next
            rank, so that one lost rank's part is restored from memory (an elastic Gloo job,
            or an MPI world that shrinks: `tandem run --backend mpi --min-np`).
        **extras: anything else to restore (an epoch, a scheduler): picklable values, or
            objects with `state_dict()`/`load_state_dict()`, by names without a leading "_".

    Raises:
        ValueError: an extra's name starts with "_", or the model or optimizer is reduced over
            a group other than the world or split so that a dying rank takes its part (tensor
            or pipeline parallel); use a replicated model, or a fixed -np with td.Checkpointer.
        TypeError: `model` is not an `nn.Module`, or an extra is a class or cannot be pickled.
    """

    #: Each commit compares the ranks' extras, parameters and buffers (tandem's own API: ranks
    #: that drifted apart are named). Horovod's states (`tandem.horovod.elastic`) compare none
    #: of them and take the source rank's model (buffers too) and extras at every `sync`.
    compare_replicas = True

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, *,
                 checkpointer: Any = None, peer_backup: bool = False, **extras: Any) -> None:
        bad = [name for name in extras if name.startswith("_")]
        if bad:
            raise ValueError(f"td.elastic.State: extra {bad[0]!r} starts with '_': give names "
                             "without it (those are the state's own)")
        fsdp = isinstance(model, torch.nn.Module) and resize.over_the_world(model)
        for owner in (model, optimizer):
            split = None if owner is None else _split_how(owner, fsdp)
            if split is not None:
                raise ValueError(
                    f"td.elastic.State: {type(owner).__name__} is {split}: its ranks hold "
                    f"different parts, so a rank that dies takes its part with it and no rank can "
                    f"send a newcomer the whole. Use a replicated model over the world "
                    f"(td.DistributedOptimizer, td.DistributedDataParallel), or state sharded over "
                    f"the world, resharded at each change (td.ZeroOptimizer over the world, "
                    f"td.fully_shard without group= or mesh=: HSDP's mesh cannot change size), in "
                    f"an elastic job, or a fixed -np with --max-restarts and td.Checkpointer, "
                    f"which reshards on load")
        if model is None and owner_of(optimizer).sharded_over_world():
            raise ValueError(
                f"td.elastic.State: {owner_of(optimizer).describe()} keeps each rank's part of "
                f"the state, named by the model's parameters: give the model too, "
                f"State(model=model, optimizer=...)")
        for name, value in extras.items():
            kept.check(name, value)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"td.elastic.State(model=...) takes an nn.Module, got "
                            f"{type(model).__name__}")
        d = self.__dict__
        d["model"], d["optimizer"], d["checkpointer"] = model, optimizer, checkpointer
        d["_fsdp"] = fsdp  # a td.fully_shard model over the world: cut again at each change
        # The state dict's names of buffers (BatchNorm's running statistics ...), compared
        # apart from the parameters so that a mismatch names which.
        d["_buffer_names"] = frozenset(name for name, _ in model.named_buffers()) \
            if isinstance(model, torch.nn.Module) else frozenset()
        d["_extras"] = dict(extras)
        d["_snapshot"] = None
        d["_commits"] = 0  # snapshots taken: ranks with more hold a newer state
        d["_reset_callbacks"] = []
        d["_round"] = None  # the round this process was in at its last look
        d["_store"] = None
        d["_warned_no_commit"] = False
        # Sharded state exists once, split over the ranks: a rank that dies takes its part
        # with it. With a peer backup each commit also hands this rank's part to the next
        # rank, which keeps the previous rank's beside its own: one lost rank (or several,
        # none next to another) is restored from memory, for one message of 1/N of the
        # sharded state per commit and that much more memory.
        d["_peer_backup"], d["_backup"] = peer_backup, None
        # The commit before the newest while some rank may not have reached the newest (its
        # backup exchange failed): (snapshot, commits, backup), or None.
        d["_previous"] = None
        # On an MPI world that shrinks, each rank's worker (its first rank, kept whatever its
        # rank after a shrink), in rank order: `td.elastic.run` sets it (`follow_workers`).
        # None elsewhere (an elastic Gloo job's worker is its `job.elastic.worker`).
        d["_workers"] = None

    # -- extras as attributes ------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        extras = self.__dict__.get("_extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"td.elastic.State has no {name!r}: give it as a keyword, "
                             f"State(..., {name}=...)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name.startswith("_"):
            self.__dict__[name] = value
        else:
            kept.check(name, value)
            self._extras[name] = value

    @property
    def commits(self) -> int:
        return self._commits

    # -- what a training loop calls ------------------------------------------------------
    def commit(self) -> None:
        """Snapshot the state in memory, then check with every rank: the same state, and
        whether the world changed (then `WorldChanged`, caught by `td.elastic.run`). With a
        `checkpointer`, also its save (on disk every `checkpointer.every` commits)."""
        if self._peer_backup and self._sharded and _resizes():
            self._commit_with_backup()
        else:
            self.save()
        self._to_checkpoint()
        self.check_host_updates()

    def _commit_with_backup(self) -> None:
        """A commit counts only once this rank's part reached the next rank: a rank killed
        before (or during) the exchange leaves every survivor on a commit whose parts all
        survive. The snapshot is taken first, sent, and only then replaces the old one; the old
        one (and its backup) is kept until the commit's allgather shows that every rank got
        this far (`check_host_updates`), since one rank's exchange may succeed where its
        neighbour's fails: `sync` then puts the ranks that moved on back on it (`settle`).
        On a shrinking MPI world no commit agrees (it has no rounds to look at), so the commit
        before stays kept until the next one."""
        pending = self._take()
        received = transfer.to_next(pending["part"])  # raises if a peer died
        self._previous = (self._snapshot, self._commits, self._backup)
        self._snapshot, self._commits = pending, self._commits + 1
        self._backup = (self._commits, received)

    def save(self) -> None:
        """The snapshot alone (Horovod's `save()`): no communication."""
        self._snapshot = self._take()
        self._commits += 1

    def _take(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = {"extras": kept.values(self._extras)}
        if self._sharded:  # this rank's boxes of the sharded state: a copy, no communication
            snapshot["part"] = {**state_pieces.take(self._sharded_objects(), self._models()),
                                "worker": self._worker()}
        if self.model is not None and not self._fsdp:
            snapshot["model"] = {k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                 for k, v in self.model.state_dict().items()}
        if self.optimizer is not None and not self._sharded:
            snapshot["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return snapshot

    def _sharded_objects(self) -> dict[str, Any]:
        """The state each rank holds a part of, by name: a model fully sharded over the world,
        the optimizer of sharded state (ZeroOptimizer's, or one over fully sharded shards)."""
        objects = {"model": self.model} if self._fsdp else {}
        if self.optimizer is not None and self._sharded:
            objects["optimizer"] = self.optimizer
        return objects

    def _models(self) -> list[torch.nn.Module]:
        """The model whose parameters name the optimizer's state."""
        return [self.model] if self.model is not None else []

    @property
    def _sharded(self) -> bool:
        """Whether some of the state is sharded over the ranks (ZeroOptimizer's, a fully
        sharded model and its optimizer's): each rank's snapshot holds its part only."""
        return owner_of(self.optimizer).sharded_over_world() or self._fsdp

    def rejoin_wrappers(self) -> None:
        """The model and the optimizer follow the new world (`td.elastic.run`, after it joined
        the new round): reducers over it, shards cut for its size."""
        for wrapper in (self.model, self.optimizer):
            owner_of(wrapper).rejoin()
        if self._fsdp:
            resize.reshard_units(self.model)

    def restore(self, shards: bool = True) -> None:
        """Back to the last snapshot (nothing to do before the first). `shards=False`: not the
        sharded parts, which a change of world cut again (`sync` gathers them)."""
        snapshot = self._snapshot
        if snapshot is None:
            return
        if self.model is not None and not self._fsdp:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None and not self._sharded:
            self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        if self._sharded and shards:
            state_pieces.fill_from([snapshot["part"]], self._sharded_objects(), self._models())
        kept.load(self._extras, snapshot["extras"])

    def check_host_updates(self) -> None:
        """Raise `WorldChanged` on every rank when the launcher formed a new round; name the
        ranks whose commits differ. One small allgather."""
        if runtime.state().job.elastic is None:
            return  # one process outside an elastic job (the reference run): nothing to check
        seen = self._look()
        digests = self._digests() if self.compare_replicas else (0, 0, 0)
        mine = torch.tensor([seen, self._commits, *digests], dtype=torch.int64)
        everyone = collectives.allgather(mine).view(-1, 5)
        self._previous = None  # every rank reached this commit: the one before is not needed
        rounds, agreed = everyone[:, 0], everyone[:, 1:]
        if bool((agreed != agreed[0]).any()):
            # failure path: what differs, by name
            extras = collectives.allgather_object(kept.values(self._extras))
            buffers = collectives.allgather_object(self._buffer_sums())
            raise StateMismatchError(_mismatch(agreed.tolist(), extras, buffers))
        if int(rounds.max()) != self._round:
            raise WorldChanged(f"round {int(rounds.max())} began (this world is round "
                               f"{self._round})")

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions `td.elastic.run` calls after each change of world (Horovod's name): to
        scale the learning rate with the world size, rebuild a data loader, ..."""
        self._reset_callbacks.extend(callbacks)

    # -- what td.elastic.run calls ---------------------------------------------------------
    def sync(self, rollback: bool = True, changed: bool = True) -> None:
        """Every rank onto the newest commit any of them holds, sent by the lowest rank that
        holds it; when none has committed, onto the checkpointer's newest checkpoint (or the
        state rank 0 started with). `rollback=False`: this rank's state is its last snapshot
        already (a commit just saw the change); `changed=False`: the first call, in the
        world the model was built in. Collective.

        Ranks that hold the same number of commits hold the same state (each commit compared
        them), so survivors of a failure, all at one commit, send nothing: each rolls back to
        its own snapshot. Only a rank behind (a newcomer, a rank that missed the last commit)
        receives, and only it takes a new snapshot."""
        if self._sharded and self._peer_backup:
            self._settle()
        counts = collectives.allgather(torch.tensor([self._commits], dtype=torch.int64))
        newest, oldest = int(counts.max()), int(counts.min())
        if rollback and self._commits in (newest, 0):  # a rank behind receives it all instead
            self.restore(shards=False)
        if self._sharded and newest > 0 and not self._reshard(newest):
            return
        if newest == oldest > 0 and self.compare_replicas:  # each commit compared them
            return
        if newest == 0:
            self._from_checkpoint()  # every rank reads the same one (or finds none)
            if self._fsdp and changed and self.checkpointer is None:
                raise RuntimeError(
                    "td.elastic: the world changed before the first State.commit(): a fully "
                    "sharded model cannot be put together again (the ranks that left took "
                    "their shards). Commit after each step (or every few), or give "
                    "State(..., checkpointer=td.Checkpointer(dir, every=N))")
        source = int(torch.argmax(counts))  # the lowest rank among those with the newest
        if self.model is not None and not self._fsdp:  # a fully sharded one: `_reshard`
            broadcast_parameters(self.model, root=source)
        if self.optimizer is not None and not self._sharded:
            broadcast_optimizer_state(self.optimizer, root=source)
        extras = collectives.broadcast_object(
            kept.values(self._extras) if runtime.rank() == source else None, root=source)
        if self._commits < newest or newest == 0:
            kept.load(self._extras, extras)
            self._snapshot = self._take()
            self._commits = newest
        elif not self.compare_replicas:  # Horovod's: every rank takes the source's, as it is
            kept.load(self._extras, extras)
            self._snapshot = self._take()

    def _reshard(self, newest: int) -> bool:
        """The sharded state of commit `newest` in this world's layout, from the ranks that
        hold its boxes (their own parts, and the peer backups of ranks that left): the
        checkpoint's box intersection, over the wire. True when they hold all of it. Else
        every rank goes on from the checkpointer's newest checkpoint (resharded on load) and
        this returns False; without one, an error names what was lost. Collective."""
        parts = [self._snapshot["part"]] if self._commits == newest else []
        if self._backup is not None and self._backup[0] == newest and self._backup[1]:
            if self._backup[1]["worker"] not in self._round_workers():  # its owner left
                parts.append(self._backup[1])
        holes = transfer.reshard(parts, self._sharded_objects(), self._models())
        if not holes:
            return True
        by_name = {label.partition(".")[2]: spans for label, spans in holes.items()}
        if self._fsdp:
            lost = "state of fully_shard's " + ", ".join(resize.lost(self.model, by_name))
        else:
            lost = f"{owner_of(self.optimizer).kind} state of " + ", ".join(
                f"flat elements [{a}, {b}) of {name}" for name, spans in by_name.items()
                for a, b in spans)
        if self.checkpointer is None:
            raise RuntimeError(
                f"td.elastic: the {lost} was held only by the rank(s) that left, so no rank "
                f"can send it. Give td.elastic.State(..., peer_backup=True) (each rank also "
                f"keeps the previous rank's part: one lost rank is restored from memory) or "
                f"a disk fallback, checkpointer=td.Checkpointer(dir, every=N) (the job goes "
                f"on from its last checkpoint)")
        if runtime.rank() == 0:
            warnings.warn(f"td.elastic: the {lost} left with the lost rank(s): going on from "
                          f"the checkpointer's newest checkpoint", stacklevel=3)
        self._from_checkpoint()
        self._snapshot = self._take()
        self._commits = newest
        return False

    def follow_workers(self, workers: list[int]) -> None:
        """On an MPI world that shrinks (`td.elastic.run`): each rank's worker, in rank
        order, for this world (the survivors after a shrink). A peer backup names its part's
        owner by worker, and `sync` restores the parts whose owner is not among them."""
        self._workers = list(workers)

    def _worker(self) -> int:
        """This process's worker: the id it keeps across changes of world."""
        job = runtime.state().job
        if job.elastic is not None:
            return job.elastic.worker
        if self._workers is not None:
            return self._workers[runtime.rank()]
        return runtime.rank()

    def _round_workers(self) -> set[int]:
        """The workers of this process's round (the survivors of a shrinking MPI world; every
        rank, outside an elastic job)."""
        job = runtime.state().job
        if job.elastic is None:
            return set(self._workers) if self._workers is not None else set(range(runtime.size()))
        self._look()
        return set(elastic_rounds.read(self._store, job.elastic.round).workers)

    def _settle(self) -> None:
        """With a peer backup, every rank onto one commit whose parts all survive: when a
        rank's backup exchange failed (a peer died during the commit) it stayed on the commit
        before, so the ranks that got further go back to theirs (kept until then). Ranks
        that never committed (newcomers) are left alone. Collective (one small allgather)."""
        previous = self._previous[1] if self._previous is not None else -1
        held = collectives.allgather(torch.tensor([self._commits, previous],
                                                  dtype=torch.int64)).view(-1, 2)
        committed = [int(c) for c in held[:, 0].tolist() if c > 0]
        if not committed:
            return
        target = min(committed)
        if self._commits > target and previous == target:
            self._snapshot, self._commits, self._backup = self._previous
            self._previous = None
            self.restore(shards=False)

    def warn_no_commit(self) -> None:
        if not self._warned_no_commit:
            self._warned_no_commit = True
            fallback = ("the checkpointer's last checkpoint" if self.checkpointer is not None
                        else "the state the job started with")
            warnings.warn(f"td.elastic: the world changed before any State.commit(): the job "
                          f"goes on from {fallback}. Call state.commit() after each step (or "
                          f"every few) to lose less", stacklevel=3)

    def _objects(self) -> dict[str, Any]:
        objects = {"model": self.model, "optimizer": self.optimizer,
                   "extras": _Extras(self._extras)}
        return {name: obj for name, obj in objects.items() if obj is not None}

    def _to_checkpoint(self) -> None:
        """The fallback on disk: the checkpointer's `every` commits."""
        if self.checkpointer is not None:
            self.checkpointer.save(self._commits - 1, **self._objects())

    def _from_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.restore(**self._objects())

    def _look(self) -> int:
        """The job's round as the store has it now (its number)."""
        store = self._store
        if store is None:
            job = runtime.state().job
            store = StoreClient(job.master_addr or "127.0.0.1", job.master_port, job.store_key,
                                runtime.state().timeout)
            self._store = store
        return elastic_rounds.current_number(store)

    def _digests(self) -> tuple[int, int, int]:
        """What every replica must have alike, as three 62-bit digests: the extras, the
        snapshot's parameters and its buffers (replicas are bitwise equal, so the sums of their
        tensors are too)."""
        extras = hashlib.blake2b(kept.digest_bytes(self._extras), digest_size=8)
        model = (self._snapshot or {}).get("model", {})
        sums = [(name in self._buffer_names, t.double().sum()) for name, t in model.items()
                if torch.is_tensor(t) and t.is_floating_point()]
        totals = [0.0, 0.0]
        if sums:  # one host read per commit, not one per tensor
            device = sums[0][1].device
            zero = torch.zeros((), dtype=torch.float64, device=device)
            pair = torch.stack([sum((x.to(device) for b, x in sums if b == buffer), zero)
                                for buffer in (False, True)])
            totals = pair.tolist()
        digests = [hashlib.blake2b(repr(total).encode(), digest_size=8) for total in totals]
        return (int.from_bytes(extras.digest(), "little") >> 2,
                *(int.from_bytes(d.digest(), "little") >> 2 for d in digests))

    def _buffer_sums(self) -> dict[str, float]:
        """Each floating buffer of the snapshot's model by its sum (the mismatch's message)."""
        model = (self._snapshot or {}).get("model", {})
        return {name: float(t.double().sum()) for name, t in model.items()
                if name in self._buffer_names and torch.is_tensor(t) and t.is_floating_point()}

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def _resizes() -> bool:
    """Whether this job's world can lose ranks and go on: an elastic Gloo job, or an MPI world
    that shrinks (`tandem run --backend mpi --min-np`)."""
    return runtime.state().job.elastic is not None or runtime.shrinks()


def _split_how(owner: Any, fsdp: bool) -> str | None:
    """How `owner` (a model or an optimizer) is split across ranks, in words; None when every
    rank holds the whole of it (the layout protocol's `splits` registry says), or when the
    state follows a change of world: ZeroOptimizer's shards, a model fully sharded over the
    world and its optimizer (`fsdp`)."""
    split = owner_of(owner)
    if split.group is not None:
        return f"reduced over {split.group!r}, not the world"
    if split.sharded_over_world():
        return None  # sharded over the world: resharded by `State.sync` (`_reshard`)
    params = (owner.parameters() if hasattr(owner, "parameters")
              else (p for g in getattr(owner, "param_groups", ()) for p in g["params"]))
    kinds = {splits.kind_of(p) for p in params} - {None}
    if fsdp and kinds <= {splits.FULLY_SHARD}:
        return None
    return f"split ({', '.join(sorted(kinds))})" if kinds else None


class _Extras:
    """The extras as a checkpointable object: plain values, and each stateful object's state
    dict (loaded back into the same object)."""

    def __init__(self, extras: dict[str, Any]) -> None:
        self.extras = extras

    def state_dict(self) -> dict[str, Any]:
        return kept.values(self.extras)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kept.load(self.extras, state)


def _mismatch(agreed: list[list[int]], extras: list[dict[str, Any]],
              buffers: list[dict[str, float]]) -> str:
    """Which ranks differ from rank 0, and in what."""
    lines = []
    hint = ""
    for rank, (commits, _, weights, buffer_digest) in enumerate(agreed):
        what = []
        if commits != agreed[0][0]:
            what.append(f"{commits} commit(s), rank 0 {agreed[0][0]}")
        differing = sorted(k for k in set(extras[rank]) | set(extras[0])  # by value: bytes
                           if pickle.dumps(extras[rank].get(k)) != pickle.dumps(extras[0].get(k)))
        what += [f"{k}={extras[rank].get(k)!r}, rank 0 {k}={extras[0].get(k)!r}"
                 for k in differing]
        if weights != agreed[0][2]:
            what.append("other model parameters")
        if buffer_digest != agreed[0][3]:
            names = sorted(k for k in set(buffers[rank]) | set(buffers[0])
                           if buffers[rank].get(k) != buffers[0].get(k))
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            what.append(f"other model buffers ({shown}: sum {buffers[rank].get(names[0])!r}, "
                        f"rank 0 {buffers[0].get(names[0])!r})" if names else
                        "other model buffers")
            hint = (". Buffers such as BatchNorm's running statistics follow each rank's own "
                    "batches: keep them alike with td.SyncBatchNorm (nn.SyncBatchNorm."
                    "convert_sync_batchnorm(model)) or td.broadcast_parameters(model) before the "
                    "commit, or use tandem.horovod's hvd.elastic.TorchState, which, as Horovod "
                    "does, compares nothing and takes rank 0's model and extras on a change")
        if what:
            lines.append(f"rank {rank}: " + "; ".join(what))
    return ("td.elastic: ranks committed different states (" + " | ".join(lines) + "). Every "
            "rank must call state.commit() at the same steps, with the same extras and a "
            "replicated model (td.DistributedOptimizer or td.DistributedDataParallel)" + hint)
