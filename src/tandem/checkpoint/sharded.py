"""Checkpoints of split models in PyTorch's Distributed Checkpoint (DCP) format, any layout to any.

    td.checkpoint.save_sharded("ckpt/step-100", model=model, optimizer=opt)    # every rank: its own pieces
    td.checkpoint.load_sharded("ckpt/step-100", model=model, optimizer=opt)    # into any other layout

`path` becomes a DCP directory: `__<r>_0.distcp` from every rank that holds something nobody
else wrote, and `.metadata` (written last, by rank 0), which records every tensor's
one-process name, global shape and dtype and which box of it each file holds. Each rank
writes the boxes of the one-process tensors that it holds (`tandem.parallel.layout.protocol`):
a replicated tensor is written once, a tensor-parallel slice or a fully sharded range by its
owner, a pipeline stage's layers by that stage. Keys follow torch's own conventions:

    <model>.<name>                      the one-process state dict (`model.fc.weight`)
    <optimizer>.state.<name>.<key>      per-parameter optimizer state (`optimizer.state.fc.weight.exp_avg`)
    <optimizer>.param_groups            hyper-parameters (bytes)
    <other>                             any other object's state_dict() (a scheduler), as bytes
    tandem                              what tandem needs to restore: object types, step, world size

so `torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id=path)` and
`format_utils.dcp_to_torch_save(path, "model.pt")` read it, and a checkpoint written by torch's
own `dcp.save({"model": ...})` loads here.

Loading is resharding: each rank asks for the boxes it now holds (any tp size, pp size,
fully_shard or ZeRO world size, or the plain model) and reads them from whichever files hold
them. Before anything is modified, every rank checks the whole checkpoint (the metadata is
there, every file it names is there and long enough, names and shapes match the model, the
optimizer is of the saved type) and the ranks agree: a problem anywhere is an error on every
rank that names it, and nothing has been loaded. The directory is written under a temporary
name and renamed into place once every file and the metadata are on disk: a crash mid-save
leaves the previous checkpoint as it was. Every rank must see the directory (a shared file
system, as for torch's distributed checkpoints).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
)

from tandem.checkpoint import dcp_files as files
from tandem.checkpoint.durable import CheckpointError, needed_bytes, no_space, place, shortfall
from tandem.parallel.layout import protocol as layout
from tandem.parallel.layout import state_pieces
from tandem.parallel.layout.state_pieces import is_model, is_optimizer

FORMAT = "tandem-dcp-1"
RECORD = "tandem"


def _type_name(obj: Any) -> str:
    """The class of an object; of an optimizer, the torch optimizer under tandem's wrappers."""
    obj = layout.innermost_optimizer(obj) or obj
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_objects(objects: dict[str, Any]) -> None:
    """Bad arguments, refused on the spot (every rank passes the same kinds of objects)."""
    for name, obj in objects.items():
        _stateful(name, obj)
        if "." in name:
            raise ValueError(f"object name {name!r}: use a name without dots (model=, optimizer=)")


def _stateful(name: str, obj: Any) -> None:
    if not (is_model(obj) or is_optimizer(obj)
            or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))):
        raise TypeError(
            f"{name}={type(obj).__name__} has no state_dict()/load_state_dict(); pass models, "
            f"optimizers, schedulers or other objects that have them")


def _gather(objects: dict[str, Any]) -> tuple[dict[str, state_pieces.Piece], dict[str, Any], dict[str, Any]]:
    """(tensor pieces, byte items, the tandem record) of everything in `objects`."""
    pieces, blobs, _ = state_pieces.pieces_of(objects)
    kinds = {}
    for name, obj in objects.items():
        if is_model(obj):
            kinds[name] = ("model", sorted(layout.split_kinds(obj)))
        elif is_optimizer(obj):
            kinds[name] = ("optimizer", _type_name(obj))
        else:
            blobs[name] = obj.state_dict()
            kinds[name] = ("object", _type_name(obj))
    record = {"format": FORMAT, "objects": kinds, "world_size": files.rank_size()[1]}
    return pieces, blobs, record


# -- saving ---------------------------------------------------------------------------------------


def start_save(path: str | os.PathLike, extra: dict[str, Any] | None = None, *,
               background: bool = False, staging: dict | None = None,
               admit: Callable[[], str | None] | None = None, **objects: Any) -> files.PendingSave:
    """Plan a save of `objects` at `path` and start writing (collective); `finish()` the result.

    The tensors are copied to host memory before this returns (into `staging`'s buffers when
    given: pass the same dict to every save, after the previous one finished); with
    `background` the files are written by a thread, and only `finish()` communicates again.
    `admit`, asked on rank 0 before anything is written: a reason to refuse the save, or None.
    A file system that cannot hold the files is refused before anything is written too.
    """
    if not objects:
        raise ValueError("nothing to save: pass the objects, e.g. save_sharded(path, model=model)")
    check_objects(objects)
    rank, size = files.rank_size()
    path = Path(os.fspath(path))
    problem, items, data, record = None, [], {}, {}
    try:
        if path.is_dir() and not (path / files.METADATA).is_file():
            raise ValueError(
                f"{str(path)!r} exists without {files.METADATA} (a save that did not complete, or "
                f"files removed by hand): move it away or restore its files; tandem neither skips "
                f"nor overwrites it")
        problem = admit() if admit is not None and rank == 0 else None
        pieces, blobs, record = _gather(objects)
        record.update(extra or {})
        blobs[RECORD] = record
        items, data = files.write_items(pieces, blobs, staging)
    except (TypeError, ValueError, NotImplementedError) as error:
        problem = f"{type(error).__name__}: {error}"
    # Two messages: every rank's plan (or problem) to all, then rank 0's verdict and global plan.
    reports = files.everyone((problem, SavePlan(items), place(path.parent)))
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(reports) if p is not None]
    verdict: tuple = (problems, None, None)
    metadata = None
    if rank == 0 and not problems:
        temporary = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
        try:
            plans = dedup_save_plans([plan for _, plan, _ in reports])
            plans, metadata = create_default_global_save_plan(plans)
            problem = shortfall(path.parent, plans, [where for _, _, where in reports])
            if problem is None:
                temporary.mkdir(parents=False)
                plans = FileSystemWriter(temporary, single_file_per_rank=True,
                                         sync_files=True).prepare_global_plan(plans)
                problem = files.incomplete(metadata)
            verdict = ([f"rank 0: {problem}"] if problem else [], str(temporary), plans)
        except OSError as error:
            full = no_space(error, path.parent, 0)
            verdict = ([f"rank 0: could not create {str(temporary)!r}: {full or error}"], None, None)
    problems, temporary, plans = files.from_root(verdict)
    if problems:
        if rank == 0 and temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(f"cannot save checkpoint {str(path)!r}: " + "; ".join(problems))
    temporary = Path(temporary)
    mine = plans[rank]
    staged = files.Staged(data)

    def write() -> list:
        writer = FileSystemWriter(temporary, single_file_per_rank=True, sync_files=True)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return writer.write_data(mine, staged).value()

    return files.PendingSave(path, temporary, metadata, write, needed_bytes(mine)).start(background)


def save_sharded(path: str | os.PathLike, **objects: Any) -> None:
    """Write a checkpoint directory at `path` in DCP format (every rank calls it; atomic).

    Args:
        path: the checkpoint directory to create (written to a temporary one, then renamed).
        **objects: what to save, by name (no dots): models of any layout, optimizers, and any
            object with `state_dict()`/`load_state_dict()`.

    Raises:
        CheckpointError: a rank could not plan or write its pieces, or the file system cannot
            hold the checkpoint (raised on every rank, naming the rank and its problem).
        ValueError: no object, a name with a dot, or `path` exists without its metadata (a
            save that did not complete: move it away).
        TypeError: an object without `state_dict()`/`load_state_dict()`.
    """
    start_save(path, **objects).finish()


# -- loading --------------------------------------------------------------------------------------


def _shape_of(metadata: Any, key: str) -> tuple | None:
    md = metadata.state_dict_metadata.get(key)
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _check_model(name: str, pieces: dict[str, state_pieces.Piece], metadata: Any) -> str | None:
    """Missing, unexpected and differently shaped names (over every rank's pieces: a pipeline
    stage expects its own layers only)."""
    expected = {}
    for piece_map in files.everyone({k: p.shape for k, p in pieces.items()}):
        expected.update(piece_map)
    prefix = f"{name}."
    saved = {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and not k.startswith(f"{name}.state.")
             and isinstance(md, TensorStorageMetadata)}
    missing = [f"{k[len(prefix):]} {list(s)}" for k, s in expected.items() if k not in saved]
    unexpected = [f"{k[len(prefix):]} {list(s)}" for k, s in saved.items() if k not in expected]
    shapes = [f"{k[len(prefix):]}: model {list(s)}, saved {list(saved[k])}"
              for k, s in expected.items() if k in saved and tuple(saved[k]) != tuple(s)]
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append("missing from the checkpoint: " + ", ".join(missing[:10]))
    if unexpected:
        parts.append("in the checkpoint but not in the model: " + ", ".join(unexpected[:10]))
    if shapes:
        parts.append("different shapes: " + "; ".join(shapes[:10]))
    return (f"its {name!r} does not match the {name} given (built a different model?): "
            + ". ".join(parts) + ". Nothing was loaded")


def _record(metadata: Any, path: Path) -> dict[str, Any]:
    if RECORD not in metadata.state_dict_metadata:
        return {}  # written by torch's own dcp.save: no tandem record
    return files.read(path, metadata, {}, [RECORD])[RECORD]


def load_sharded(path: str | os.PathLike, **objects: Any) -> dict[str, Any]:
    """Load a checkpoint into `objects`, whatever layout each now has (every rank calls it).

    Nothing is modified unless the whole checkpoint is there and matches the objects; returns
    the tandem record saved with it (e.g. `completed` steps), {} for a checkpoint torch wrote.

    Args:
        path: the checkpoint directory (`save_sharded`'s, or one torch's `dcp.save` wrote).
        **objects: what to load into, by the names they were saved under; each in any layout.

    Returns:
        The tandem record saved with the checkpoint (e.g. `{"completed": steps}`), {} for a
        checkpoint torch wrote.

    Raises:
        CheckpointError: the checkpoint is missing or incomplete, has no state for a name,
            holds another model (missing, unexpected or other-shaped names listed) or an
            optimizer of another class; raised on every rank before anything is modified.
        CorruptCheckpointError: a file is truncated or fails its checksum.
        ValueError: a name with a dot.
        TypeError: an object without `state_dict()`/`load_state_dict()`.
    """
    check_objects(objects)
    path = Path(os.fspath(path))
    metadata = files.read_metadata(path)
    record = _record(metadata, path)
    saved_kinds = record.get("objects", {})
    models = [obj for obj in objects.values() if is_model(obj)]
    problem = None
    plan: dict[str, Any] = {}
    try:
        keys = set(metadata.state_dict_metadata)
        for name, obj in objects.items():
            present = any(k == name or k.startswith(f"{name}.") for k in keys)
            if not present:
                held = sorted({k.split(".")[0] for k in keys} - {RECORD})
                raise KeyError(f"the checkpoint has no state for {name!r}; it holds {held}: restore "
                               f"the names you saved")
            if is_optimizer(obj) and name in saved_kinds:
                saved_type = saved_kinds[name][1]
                mine = _type_name(obj)
                if saved_type != mine:
                    raise TypeError(f"{name!r} was saved from {saved_type.rsplit('.', 1)[-1]} "
                                    f"({saved_type}) but is restored into "
                                    f"{mine.rsplit('.', 1)[-1]} ({mine}): build the optimizer the "
                                    f"checkpoint was saved with")
    except (KeyError, TypeError) as error:
        problem = str(error.args[0]) if error.args else str(error)  # KeyError's str() quotes it
    files.settle(problem, f"cannot load checkpoint {str(path)!r}")
    for name, obj in objects.items():
        if is_model(obj):
            plan[name] = state_pieces.model_pieces(name, obj)
            files.settle(_check_model(name, plan[name], metadata), f"cannot load checkpoint {str(path)!r}")
    problem = None
    optimizer_plans = {}
    try:
        for name, obj in objects.items():
            if is_optimizer(obj):
                optimizer_plans[name] = _optimizer_plan(name, obj, models, metadata)
    except (ValueError, TypeError, KeyError) as error:
        problem = f"{type(error).__name__}: {error}"
    files.settle(problem, f"cannot load checkpoint {str(path)!r}")
    # Everything checked on every rank: now read.
    for name, obj in objects.items():
        if is_model(obj):
            files.read(path, metadata, {k: p.chunks for k, p in plan[name].items()}, [])
        elif is_optimizer(obj):
            _load_optimizer(path, metadata, optimizer_plans[name])
        else:
            obj.load_state_dict(files.read(path, metadata, {}, [name])[name])
    return record


def _optimizer_plan(name: str, optimizer: Any, models: list[Any], metadata: Any
                    ) -> state_pieces.OptimizerTargets:
    saved = {key: (tuple(md.size), md.properties.dtype) if isinstance(md, TensorStorageMetadata)
             else None for key, md in metadata.state_dict_metadata.items()}
    return state_pieces.optimizer_targets(name, optimizer, models, saved)


def _load_optimizer(path: Path, metadata: Any, targets: state_pieces.OptimizerTargets) -> None:
    values = files.read(path, metadata, targets.reads,
                        [targets.groups_key] + [key for _, _, key in targets.values])
    try:
        targets.load(values)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
