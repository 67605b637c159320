"""Checkpoints of split models in PyTorch's Distributed Checkpoint (DCP) format, any layout to any.

    td.save_sharded("ckpt/step-100", model=model, optimizer=opt)    # every rank: its own pieces
    td.load_sharded("ckpt/step-100", model=model, optimizer=opt)    # into any other layout

`path` becomes a DCP directory: `__<r>_0.distcp` from every rank that holds something nobody
else wrote, and `.metadata` (written last, by rank 0), which records every tensor's
one-process name, global shape and dtype and which box of it each file holds. Each rank
writes the boxes of the one-process tensors that it holds (`tandem.parallel.layout`):
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

import io
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tandem import runtime
from tandem.comm import collectives
from tandem.files import CheckpointError, fsync_directory
from tandem.parallel import layout
from tandem.parallel.pipeline.stage import Pipeline

FORMAT = "tandem-dcp-1"
METADATA = ".metadata"
RECORD = "tandem"
# Test hook: called on rank 0 with the temporary directory once every file is written, just
# before it is renamed into place. The crash test SIGKILLs its own process there.
_before_publish: Callable[[Path], None] | None = None


def _rank_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _all(obj: Any) -> list[Any]:
    return collectives.allgather_object(obj) if _rank_size()[1] > 1 else [obj]


def _from_root(obj: Any) -> Any:
    return collectives.broadcast_object(obj, root=0) if _rank_size()[1] > 1 else obj


def _settle(problem: str | None, what: str) -> None:
    """Raise on every rank if any rank has a problem (the first one, naming its rank)."""
    problems = [(r, p) for r, p in enumerate(_all(problem)) if p is not None]
    if problems:
        rank, text = problems[0]
        more = f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"{what}: rank {rank}: {text}{more}")


def is_model(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, Pipeline))


def is_optimizer(obj: Any) -> bool:
    return layout.innermost_optimizer(obj) is not None


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


# -- what this rank holds: the tensors to write, or to read into -------------------------------


@dataclass
class _Piece:
    key: str
    shape: tuple[int, ...]
    chunks: list[tuple[layout.Chunk, torch.Tensor]] = field(default_factory=list)  # (box, local)


def _model_pieces(name: str, model: Any) -> dict[str, _Piece]:
    pieces: dict[str, _Piece] = {}
    for held in layout.held(model):
        for placement, chunk in layout.iter_chunks(held):
            piece = pieces.setdefault(f"{name}.{placement.name}",
                                      _Piece(f"{name}.{placement.name}", placement.shape))
            piece.chunks.append((chunk, held.tensor))
        for placement in held.placements:
            pieces.setdefault(f"{name}.{placement.name}", _Piece(f"{name}.{placement.name}", placement.shape))
    return pieces


def _optimizer_pieces(name: str, optimizer: Any, models: list[Any]
                      ) -> tuple[dict[str, _Piece], dict[str, Any], dict]:
    """(tensor state pieces, non-tensor state by key, param_groups with parameter names)."""
    inner, params = layout.optimizer_params(optimizer, models)
    pieces: dict[str, _Piece] = {}
    others: dict[str, Any] = {}
    names_of = {}
    for p, placements in params:
        names_of[id(p)] = [pl.name for pl in placements]
        for k, v in inner.state.get(p, {}).items():
            if layout.per_element(k, v, p):
                for placement in placements:
                    piece = pieces.setdefault(f"{name}.state.{placement.name}.{k}",
                                              _Piece(f"{name}.state.{placement.name}.{k}", placement.shape))
                    piece.chunks += [(chunk, v) for chunk in placement.chunks]
            elif isinstance(v, torch.Tensor):
                for placement in placements:  # a scalar (Adam's step): one per name
                    key = f"{name}.state.{placement.name}.{k}"
                    pieces[key] = _Piece(key, tuple(v.shape), [(layout.whole(key, v).chunks[0], v)])
            elif v is not None:
                for placement in placements:
                    others[f"{name}.state.{placement.name}.{k}"] = v
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [n for p in g["params"] for n in names_of[id(p)]]} for g in inner.param_groups]
    return pieces, others, groups


def _gather(objects: dict[str, Any]) -> tuple[dict[str, _Piece], dict[str, Any], dict[str, Any]]:
    """(tensor pieces, byte items, the tandem record) of everything in `objects`."""
    models = [obj for obj in objects.values() if is_model(obj)]
    pieces: dict[str, _Piece] = {}
    blobs: dict[str, Any] = {}
    kinds = {}
    for name, obj in objects.items():
        if is_model(obj):
            pieces.update(_model_pieces(name, obj))
            kinds[name] = ("model", sorted(layout.split_kinds(obj)))
        elif is_optimizer(obj):
            tensors, others, groups = _optimizer_pieces(name, obj, models)
            pieces.update(tensors)
            blobs.update(others)
            blobs[f"{name}.param_groups"] = groups
            kinds[name] = ("optimizer", _type_name(obj))
        else:
            blobs[name] = obj.state_dict()
            kinds[name] = ("object", _type_name(obj))
    record = {"format": FORMAT, "objects": kinds, "world_size": _rank_size()[1]}
    return pieces, blobs, record


# -- saving ---------------------------------------------------------------------------------------


def _bytes(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _write_items(pieces: dict[str, _Piece], blobs: dict[str, Any], staging: dict | None
                 ) -> tuple[list[WriteItem], dict]:
    """DCP write items and the data behind each, copied to host memory now (so that training
    can go on changing the tensors while a background thread writes). `staging`: host buffers
    kept from the previous save, reused (a fresh allocation's first touch costs more than the
    copy itself)."""
    items, data = [], {}
    for piece in pieces.values():
        for chunk, local in piece.chunks:
            index = MetadataIndex(piece.key, torch.Size(chunk.offsets))
            view = chunk.view(local).detach()
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)),
                properties=TensorProperties(dtype=view.dtype), size=torch.Size(piece.shape))))
            buffer = None if staging is None else staging.get(index)
            if buffer is None or buffer.shape != view.shape or buffer.dtype != view.dtype:
                buffer = torch.empty(view.shape, dtype=view.dtype, device="cpu")
                if staging is not None:
                    staging[index] = buffer
            data[index] = buffer.copy_(view)
    for key, value in blobs.items():
        buffer = _bytes(value)
        index = MetadataIndex(key)
        items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO,
                               bytes_io_data=BytesIOWriteData(nbytes=len(buffer.getbuffer()))))
        data[index] = buffer
    return items, data


class _Staged:
    """What `SavePlanner` would be to the DCP writer: it hands over the staged data."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def resolve_data(self, item: WriteItem) -> Any:
        value = self._data[item.index]
        if isinstance(value, io.BytesIO):
            value.seek(0)
        return value


def _incomplete(metadata: Any) -> str | None:
    """A tensor whose boxes do not cover it (a layout bug): never publish such a checkpoint."""
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            held = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
            if held != int(md.size.numel()):
                return f"the ranks hold {held} of the {int(md.size.numel())} elements of {key}"
    return None


class PendingSave:
    """A save whose files are being written (in the background with `async_save`); `finish()`
    (every rank) waits for them, writes the metadata and renames the directory into place."""

    def __init__(self, path: Path, temporary: Path, metadata: Any, run: Callable[[], list]) -> None:
        self.path, self.temporary, self.metadata = path, temporary, metadata
        self._results: list | None = None
        self._error: BaseException | None = None
        self._thread = None
        self._run = run

    def start(self, background: bool) -> PendingSave:
        if not background:
            self._work()
            return self
        import threading

        self._thread = threading.Thread(target=self._work, name="tandem-checkpoint", daemon=True)
        self._thread.start()
        return self

    def _work(self) -> None:
        try:
            self._results = self._run()
        except BaseException as error:  # noqa: BLE001 - reported to every rank by finish()
            self._error = error

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        rank, _ = _rank_size()
        mine = None if self._error is None else f"could not write its files: {self._error}"
        everyone = _all((mine, self._results or []))
        problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(everyone) if p is not None]
        if not problems and rank == 0:
            try:
                writer = FileSystemWriter(self.temporary, single_file_per_rank=True, sync_files=True)
                writer.set_up_storage_writer(True, rank=0, use_collectives=True)
                writer.finish(self.metadata, [results for _, results in everyone])
                fsync_directory(self.temporary)
                if _before_publish is not None:
                    _before_publish(self.temporary)
                _publish(self.temporary, self.path)
            except OSError as error:
                problems.append(f"rank 0 could not publish the checkpoint: {error}")
        problems = _from_root(problems)
        if problems:
            if rank == 0:
                shutil.rmtree(self.temporary, ignore_errors=True)
            raise CheckpointError(f"could not save checkpoint {str(self.path)!r}: " + "; ".join(problems))


def start_save(path: str | os.PathLike, extra: dict[str, Any] | None = None, *,
               background: bool = False, staging: dict | None = None, **objects: Any) -> PendingSave:
    """Plan a save of `objects` at `path` and start writing (collective); `finish()` the result.

    The tensors are copied to host memory before this returns (into `staging`'s buffers when
    given: pass the same dict to every save, after the previous one finished); with
    `background` the files are written by a thread, and only `finish()` communicates again.
    """
    if not objects:
        raise ValueError("nothing to save: pass the objects, e.g. save_sharded(path, model=model)")
    check_objects(objects)
    rank, size = _rank_size()
    path = Path(os.fspath(path))
    problem, items, data, record = None, [], {}, {}
    try:
        pieces, blobs, record = _gather(objects)
        record.update(extra or {})
        blobs[RECORD] = record
        items, data = _write_items(pieces, blobs, staging)
    except (TypeError, ValueError, NotImplementedError) as error:
        problem = f"{type(error).__name__}: {error}"
    _settle(problem, f"cannot save checkpoint {str(path)!r}")
    token = _from_root(secrets.token_hex(6) if rank == 0 else None)
    temporary = path.parent / f".{path.name}.tmp-{token}"
    problem = None
    if rank == 0:
        try:
            temporary.mkdir(parents=False)
        except OSError as error:
            problem = f"could not create {str(temporary)!r}: {error}"
    _settle(problem, f"cannot save checkpoint {str(path)!r}")
    plans = _all(SavePlan(items))
    metadata = None
    if rank == 0:
        plans = dedup_save_plans(plans)
        plans, metadata = create_default_global_save_plan(plans)
        writer = FileSystemWriter(temporary, single_file_per_rank=True, sync_files=True)
        plans = writer.prepare_global_plan(plans)
        problem = _incomplete(metadata)
    _settle(problem, f"cannot save checkpoint {str(path)!r}")
    mine = _from_root(plans)[rank]  # a few hundred bytes per item: one broadcast suffices
    staged = _Staged(data)

    def write() -> list:
        writer = FileSystemWriter(temporary, single_file_per_rank=True, sync_files=True)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return writer.write_data(mine, staged).value()

    return PendingSave(path, temporary, metadata, write).start(background)


def save_sharded(path: str | os.PathLike, **objects: Any) -> None:
    """Write a checkpoint directory at `path` in DCP format (every rank calls it; atomic)."""
    start_save(path, **objects).finish()


def _publish(temporary: Path, path: Path) -> None:
    """Rename the finished directory into place; an older one at `path` goes after."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{secrets.token_hex(6)}"
        os.replace(path, old)
    os.replace(temporary, path)
    fsync_directory(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(path: Path) -> None:
    """Temporary directories of saves that crashed before they were published (rank 0)."""
    for leftover in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- loading --------------------------------------------------------------------------------------


def read_metadata(path: Path) -> Any:
    """The checkpoint's metadata, after checking on every rank that every file it names is there
    and long enough (a truncated or missing file is found before anything loads)."""
    problem, metadata = None, None
    try:
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {str(path)!r}")
        if not (path / METADATA).is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has no {METADATA}: not a distributed checkpoint, or its save did "
                f"not complete (the metadata is written last); load an earlier checkpoint")
        metadata = FileSystemReader(path).read_metadata()
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, length in sorted(needed.items()):
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{name} is missing; the checkpoint is incomplete (copy every "
                                      f"file of the directory, or load an earlier checkpoint)")
            if file.stat().st_size < length:
                raise CheckpointError(f"{name} is truncated ({file.stat().st_size} bytes, the "
                                      f"metadata needs {length}); load an earlier checkpoint")
    except (OSError, CheckpointError) as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001 - a foreign or corrupt metadata file
        problem = f"{METADATA} is unreadable ({type(error).__name__}: {error})"
    _settle(problem, f"cannot load checkpoint {str(path)!r}")
    return metadata


class _Targets:
    """What `LoadPlanner` would be to the DCP reader: where each box read goes."""

    def __init__(self) -> None:
        self.views: dict[str, list[torch.Tensor]] = {}
        self.blobs: dict[str, Any] = {}

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        target = self.views[item.dest_index.fqn][item.dest_index.index]
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        pass  # written in place: the views are the model's own tensors

    def load_bytes(self, item: Any, value: io.BytesIO) -> None:
        value.seek(0)
        self.blobs[item.dest_index.fqn] = torch.load(value, weights_only=True)


def _read(path: Path, metadata: Any, tensors: dict[str, list[tuple[layout.Chunk, torch.Tensor]]],
          blobs: list[str]) -> dict[str, Any]:
    """Read each box into its local tensor, and the byte items; returns the byte items."""
    targets = _Targets()
    items = []
    for key, chunks in tensors.items():
        if not chunks:
            continue
        targets.views[key] = [chunk.view(local) for chunk, local in chunks]
        local_chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c, _ in chunks]
        items += create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], local_chunks)
    for key in blobs:
        from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

        items.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
    reader = FileSystemReader(path)
    reader.set_up_storage_reader(metadata, True)
    with torch.no_grad():
        reader.read_data(LoadPlan(items), targets).wait()
    return targets.blobs


def _shape_of(metadata: Any, key: str) -> tuple | None:
    md = metadata.state_dict_metadata.get(key)
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _check_model(name: str, pieces: dict[str, _Piece], metadata: Any) -> str | None:
    """Missing, unexpected and differently shaped names (over every rank's pieces: a pipeline
    stage expects its own layers only)."""
    expected = {}
    for piece_map in _all({k: p.shape for k, p in pieces.items()}):
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
    return _read(path, metadata, {}, [RECORD])[RECORD]


def load_sharded(path: str | os.PathLike, **objects: Any) -> dict[str, Any]:
    """Load a checkpoint into `objects`, whatever layout each now has (every rank calls it).

    Nothing is modified unless the whole checkpoint is there and matches the objects; returns
    the tandem record saved with it (e.g. `completed` steps), {} for a checkpoint torch wrote.
    """
    check_objects(objects)
    path = Path(os.fspath(path))
    metadata = read_metadata(path)
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
                    raise TypeError(f"{name!r} was saved from a {saved_type.rsplit('.', 1)[-1]} "
                                    f"({saved_type}) but is restored into a "
                                    f"{mine.rsplit('.', 1)[-1]} ({mine}): build the optimizer the "
                                    f"checkpoint was saved with")
    except (KeyError, TypeError) as error:
        problem = str(error).strip("'\"")
    _settle(problem, f"cannot load checkpoint {str(path)!r}")
    for name, obj in objects.items():
        if is_model(obj):
            plan[name] = _model_pieces(name, obj)
            _settle(_check_model(name, plan[name], metadata), f"cannot load checkpoint {str(path)!r}")
    problem = None
    optimizer_plans = {}
    try:
        for name, obj in objects.items():
            if is_optimizer(obj):
                optimizer_plans[name] = _optimizer_plan(name, obj, models, metadata)
    except (ValueError, TypeError, KeyError) as error:
        problem = f"{type(error).__name__}: {error}"
    _settle(problem, f"cannot load checkpoint {str(path)!r}")
    # Everything checked on every rank: now read.
    for name, obj in objects.items():
        if is_model(obj):
            _read(path, metadata, {k: p.chunks for k, p in plan[name].items()}, [])
        elif is_optimizer(obj):
            _load_optimizer(path, metadata, obj, *optimizer_plans[name])
        else:
            obj.load_state_dict(_read(path, metadata, {}, [name])[name])
    return record


def _optimizer_plan(name: str, optimizer: Any, models: list[Any], metadata: Any):
    inner, params = layout.optimizer_params(optimizer, models)
    keys = metadata.state_dict_metadata
    groups_key = f"{name}.param_groups"
    if groups_key not in keys:
        raise KeyError(f"the checkpoint has no {groups_key}")
    state: dict[int, dict[str, Any]] = {}
    reads: dict[str, list[tuple[layout.Chunk, torch.Tensor]]] = {}
    blobs: list[tuple[int, str, str]] = []
    for i, (p, placements) in enumerate(params):
        for placement in placements:
            prefix = f"{name}.state.{placement.name}."
            for key, md in keys.items():
                if not key.startswith(prefix) or "." in key[len(prefix):]:
                    continue
                k = key[len(prefix):]
                entry = state.setdefault(i, {})
                if isinstance(md, BytesStorageMetadata):
                    if k not in entry:
                        entry[k] = None
                        blobs.append((i, k, key))
                    continue
                saved_shape = tuple(md.size)
                if saved_shape == placement.shape and (saved_shape != () or k != "step"):
                    if k not in entry:
                        entry[k] = torch.zeros_like(p.detach())
                    reads.setdefault(key, []).extend((c, entry[k]) for c in placement.chunks)
                elif k not in entry:
                    entry[k] = torch.zeros(saved_shape, dtype=md.properties.dtype)
                    chunk = layout.whole(key, entry[k]).chunks[0]
                    reads.setdefault(key, []).append((chunk, entry[k]))
    return inner, params, state, reads, blobs, groups_key


def _load_optimizer(path: Path, metadata: Any, optimizer: Any, inner, params, state, reads, blobs,
                    groups_key) -> None:
    values = _read(path, metadata, reads, [groups_key] + [key for _, _, key in blobs])
    for i, k, key in blobs:
        state[i][k] = values[key]
    saved_groups = values[groups_key]
    if len(saved_groups) != len(inner.param_groups):
        raise CheckpointError(f"the optimizer has {len(inner.param_groups)} param groups, the "
                              f"checkpoint {len(saved_groups)}: build it as when it was saved")
    index, groups = 0, []
    for saved, group in zip(saved_groups, inner.param_groups, strict=True):
        n = len(group["params"])
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": list(range(index, index + n))})
        index += n
    for i, (p, _) in enumerate(params):
        for k, v in list(state.get(i, {}).items()):
            if isinstance(v, torch.Tensor):
                state[i][k] = v.to(p.device) if v.dim() else v
    inner.load_state_dict({"state": state, "param_groups": groups})
