"""The files of a distributed checkpoint: PyTorch's DCP writer and reader driven by tandem's engine.

torch's `dcp.save`/`dcp.load` coordinate ranks through a torch process group; tandem's ranks
may have none (the MPI engine), so this module drives the same `FileSystemWriter` and
`FileSystemReader` itself: each rank's write items (boxes of one-process tensors, and byte
items) are exchanged with tandem's collectives, rank 0 makes the global plan and the metadata
with torch's own planner functions (so the files are exactly DCP's), every rank writes its
file (in a thread, for async saves), and rank 0 writes `.metadata` last and renames the
directory into place. Reading checks, on every rank, that every file the metadata names is
there and long enough, then reads each box a rank holds from the files that overlap it.
What the boxes are is `tandem.checkpoint.sharded`'s business (through `parallel/layout/protocol.py`).
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)

from tandem import runtime
from tandem.checkpoint import checksums
from tandem.checkpoint.durable import CheckpointError, CorruptCheckpointError, fsync_directory, no_space
from tandem.comm.collectives import user as collectives
from tandem.parallel.layout import protocol as layout
from tandem.parallel.layout.state_pieces import Piece

METADATA = ".metadata"
# Test hook: called on rank 0 with the temporary directory once every file is written, just
# before it is renamed into place. The crash tests SIGKILL their own process there.
_before_publish: Callable[[Path], None] | None = None


def rank_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def everyone(obj: Any) -> list[Any]:
    return collectives.allgather_object(obj) if rank_size()[1] > 1 else [obj]


def from_root(obj: Any) -> Any:
    return collectives.broadcast_object(obj, root=0) if rank_size()[1] > 1 else obj


def settle(problem: str | None, what: str, error: type[CheckpointError] = CheckpointError) -> None:
    """Raise on every rank if any rank has a problem (the first one, naming its rank)."""
    problems = [(r, p) for r, p in enumerate(everyone(problem)) if p is not None]
    if problems:
        rank, text = problems[0]
        more = f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else ""
        raise error(f"{what}: rank {rank}: {text}{more}")


def _bytes(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def write_items(pieces: dict[str, Piece], blobs: dict[str, Any], staging: dict | None
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


class Staged:
    """What `SavePlanner` would be to the DCP writer: it hands over the staged data."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def resolve_data(self, item: WriteItem) -> Any:
        value = self._data[item.index]
        if isinstance(value, io.BytesIO):
            value.seek(0)
        return value


def incomplete(metadata: Any) -> str | None:
    """A tensor whose boxes do not cover it (a layout bug): never publish such a checkpoint."""
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            held = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
            if held != int(md.size.numel()):
                return f"the ranks hold {held} of the {int(md.size.numel())} elements of {key}"
    return None


class PendingSave:
    """A save whose files are being written (in the background with `async_save`); `finish()`
    (every rank) waits for them, writes the metadata and renames the directory into place.

    Each rank's writer also takes the checksums of what it wrote (`tandem.checkpoint.checksums`). When the
    engine is gone (`td.shutdown()`, interpreter exit) `finish()` publishes through the files
    instead (`finish_through_files`): each rank leaves a mark in the directory, rank 0 waits for
    every mark (with a deadline) and publishes.
    """

    def __init__(self, path: Path, temporary: Path, metadata: Any, run: Callable[[], list],
                 needed: int = 0) -> None:
        self.path, self.temporary, self.metadata = path, temporary, metadata
        self.needed = needed  # bytes this rank writes, at least (for a full disk's message)
        self.rank, self.size = rank_size()
        self._world = runtime.state() if runtime.is_initialized() else None
        self._results: list | None = None
        self._sums: dict = {}
        self._error: BaseException | None = None
        self._thread = None
        self._run = run

    def start(self, background: bool) -> PendingSave:
        if not background:
            self._work()
            return self
        self._thread = threading.Thread(target=self._work, name="tandem-checkpoint", daemon=True)
        self._thread.start()
        return self

    def _work(self) -> None:
        try:
            self._results = self._run()
            self._sums = checksums.of_results(self.temporary, self._results)
        except BaseException as error:  # noqa: BLE001 - reported to every rank by finish()
            self._error = error

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def _problem(self) -> str | None:
        if self._error is None:
            return None
        full = no_space(self._error, self.temporary, self.needed)
        return f"could not write its files: {full or self._error}"

    def engine_gone(self) -> bool:
        """The world this save started in is no more (td.shutdown): no collective can finish it."""
        return self.size > 1 and (not runtime.is_initialized() or runtime.state() is not self._world)

    def finish(self) -> None:
        if self.engine_gone():
            problem = self.finish_through_files(runtime_timeout())
            if problem:
                raise CheckpointError(f"could not save checkpoint {str(self.path)!r}: {problem}")
            return
        if self._thread is not None:
            self._thread.join()
        reports = everyone((self._problem(), self._results or [], self._sums))
        problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(reports) if p is not None]
        if not problems and self.rank == 0:
            problem = self._publish([results for _, results, _ in reports], [s for _, _, s in reports])
            problems += [problem] if problem else []
        problems = from_root(problems)
        if problems:
            if self.rank == 0:
                shutil.rmtree(self.temporary, ignore_errors=True)
            raise CheckpointError(f"could not save checkpoint {str(self.path)!r}: " + "; ".join(problems))

    def _publish(self, results: list[list], sums: list[dict]) -> str | None:
        """Rank 0: the metadata (with every rank's checksums), then the rename; a problem or None."""
        try:
            writer = FileSystemWriter(self.temporary, single_file_per_rank=True, sync_files=True)
            writer.set_up_storage_writer(True, rank=0, use_collectives=True)
            checksums.attach(self.metadata, sums)
            writer.finish(self.metadata, results)
            fsync_directory(self.temporary)
            if _before_publish is not None:
                _before_publish(self.temporary)
            publish(self.temporary, self.path)
        except OSError as error:
            return f"rank 0 could not publish the checkpoint: {no_space(error, self.temporary, 0) or error}"
        return None

    def finish_through_files(self, deadline_s: float) -> str | None:
        """Publish with no engine: every rank marks its files done, rank 0 waits for all the marks
        (until `deadline_s`) and publishes. Returns rank 0's problem (None elsewhere, or when
        published)."""
        deadline = time.monotonic() + deadline_s
        if self._thread is not None:
            self._thread.join(deadline_s)
        problem = self._problem()
        if not self.done():
            problem = f"its files were still being written after {deadline_s:.0f} s"
        mark = self.temporary / f".done-{self.rank}"
        try:
            (self.temporary / f".done-{self.rank}.tmp").write_bytes(
                pickle.dumps((problem, self._results or [], self._sums)))
            os.replace(self.temporary / f".done-{self.rank}.tmp", mark)
        except OSError as error:
            problem = f"rank {self.rank} could not leave its mark in {str(self.temporary)!r}: {error}"
        if self.rank != 0:
            return None
        marks = [self.temporary / f".done-{r}" for r in range(self.size)]
        pause = 0.01
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(pause)  # other processes' files: nothing to wait on but the file system
            pause = min(pause * 2, 0.5)
        missing = [r for r, m in enumerate(marks) if not m.exists()]
        if missing:
            return f"rank(s) {missing} did not finish their files within {deadline_s:.0f} s"
        reports = [pickle.loads(m.read_bytes()) for m in marks]
        problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(reports) if p is not None]
        for m in marks:
            m.unlink(missing_ok=True)
        if problems:
            return "; ".join(problems)
        return self._publish([results for _, results, _ in reports], [s for _, _, s in reports])


def runtime_timeout() -> float:
    """How long a wait may last in this job (the engine's timeout; the default without one)."""
    from tandem.job import settings

    return settings.current().timeout_s


def publish(temporary: Path, path: Path) -> None:
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


def read_metadata(path: Path) -> Any:
    """The checkpoint's metadata, after checking on every rank that every file it names is there
    and long enough (a truncated or missing file is found before anything loads), and that the
    bytes match their checksums (the ranks share the files out)."""
    problem, metadata = None, None
    if not path.is_dir():
        problem = f"no checkpoint directory at {str(path)!r}"
    elif not (path / METADATA).is_file():
        problem = (f"{str(path)!r} has no {METADATA}: not a distributed checkpoint, or its save did "
                   f"not complete (the metadata is written last); load an earlier checkpoint")
    else:
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as error:  # noqa: BLE001 - a foreign or corrupt metadata file
            problem = f"{METADATA} is unreadable ({type(error).__name__}: {error})"
    where = f"cannot load checkpoint {str(path)!r}"
    settle(problem, where, CheckpointError if metadata is None else CorruptCheckpointError)
    problem = None
    try:
        problem = _damage(path, metadata)
        if problem is None:
            problem = checksums.check(path, metadata, *rank_size())
    except OSError as error:
        problem = f"a file could not be read ({error})"
    settle(problem and f"{problem}. Nothing was loaded; load an earlier checkpoint", where,
           CorruptCheckpointError)
    return metadata


def _damage(path: Path, metadata: Any) -> str | None:
    """A file the metadata names that is missing or shorter than the metadata says."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return (f"{name} is missing; the checkpoint is incomplete (copy every file of the "
                    f"directory)")
        if file.stat().st_size < length:
            return f"{name} is truncated ({file.stat().st_size} bytes, the metadata needs {length})"
    return None


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


def read(path: Path, metadata: Any, tensors: dict[str, list[tuple[layout.Chunk, torch.Tensor]]],
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

        items.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
    reader = FileSystemReader(path)
    reader.set_up_storage_reader(metadata, True)
    with torch.no_grad():
        reader.read_data(LoadPlan(items), targets).wait()
    return targets.blobs
