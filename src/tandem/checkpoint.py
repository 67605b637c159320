"""Checkpoints that survive crashes: `save` writes atomically on rank 0, `load` agrees everywhere.

    td.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": e}, "ckpt.pt")
    state = td.load("ckpt.pt")          # the same object on every rank

`save` (every rank calls it): rank 0 writes the object with `torch.save` to a temporary file
next to the target (`.NAME.tmp-<random>`, same directory so the rename cannot cross
filesystems), flushes and fsyncs it, renames it over the target with `os.replace` (atomic on
POSIX) and fsyncs the directory so the rename itself is durable. A crash at any point leaves
either the previous checkpoint or the new one, never a mix; the orphaned temporary file is
removed by the next successful save. The other ranks wait for rank 0's verdict, so when `save`
returns anywhere the file is complete, and when the write failed every rank raises.

`load` (every rank calls it): rank 0 reads the file's bytes and broadcasts them; every rank
then unpickles the same bytes. This works when the file exists only on rank 0's machine (no
shared filesystem, which is also where `save` puts it), and guarantees every rank gets the
same object. The price is one broadcast of the file, which is fine for checkpoints that fit in
memory twice; for very large sharded states, save one file per rank with `torch.save` instead.

Without `td.init()` (a notebook inspecting a checkpoint) both work as a world of one.
With `ZeroOptimizer`, `opt.state_dict()` gathers the full state (a collective: every rank calls
it), so `td.save(opt.state_dict(), path)` is called on every rank, as usual.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem import runtime
from tandem.comm import collectives

PathLike = str | os.PathLike

# Test hook: called with the temporary file after it is written and fsynced, just before the
# rename. The crash test sets it to SIGKILL its own process there.
_before_replace: Callable[[Path], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def _distributed() -> bool:
    return runtime.is_initialized() and runtime.size() > 1


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not possible on this platform (Windows); the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; nothing more to do
    finally:
        os.close(fd)


def _write_atomically(obj: Any, path: Path) -> None:
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(
            f"cannot save checkpoint {str(path)!r}: directory {str(directory)!r} does not exist "
            f"on rank 0; create it first (os.makedirs)"
        )
    prefix = f".{path.name}.tmp-"
    temporary = directory / f"{prefix}{secrets.token_hex(6)}"
    # O_EXCL: never write into someone else's file; mode 0o666 lets the umask decide, as for
    # any ordinary file (mkstemp would make it private).
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        if _before_replace is not None:
            _before_replace(temporary)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)
    for leftover in directory.glob(f"{prefix}*"):  # from saves that crashed before the rename
        try:
            leftover.unlink()
        except OSError:
            pass


def save(obj: Any, path: PathLike) -> None:
    """Write `obj` to `path` on rank 0, atomically; return on every rank once it is complete.

    Every rank must call it. Anything `torch.save` accepts can be saved; the other ranks'
    `obj` is ignored. Raises on every rank if rank 0 could not write.
    """
    path = Path(os.fspath(path))
    if not _distributed():
        _write_atomically(obj, path)
        return
    failure, cause = None, None
    if runtime.rank() == 0:
        try:
            _write_atomically(obj, path)
        except Exception as error:  # reported to every rank below, then raised here too
            failure = f"{type(error).__name__}: {error}"
            cause = error
    # Doubles as the barrier: nobody returns before rank 0 has renamed the file into place.
    failure = collectives.broadcast_object(failure, root=0)
    if failure is not None:
        message = f"rank 0 could not save checkpoint {str(path)!r}: {failure}"
        if runtime.rank() == 0:
            raise CheckpointError(message) from cause
        raise CheckpointError(message)


def _read_bytes(path: Path) -> torch.Tensor:
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        data = torch.empty(size, dtype=torch.uint8)
        view = memoryview(data.numpy())
        read = 0
        while read < size:
            n = file.readinto(view[read:])
            if not n:
                raise CheckpointError(f"checkpoint {str(path)!r} shrank while being read")
            read += n
    return data


def _unpickle(data: torch.Tensor, path: Path, map_location: Any, weights_only: bool) -> Any:
    try:
        return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=map_location,
                          weights_only=weights_only)
    except Exception as error:
        text = str(error)
        refused = [line.strip() for line in text.splitlines() if "Unsupported global" in line]
        if weights_only and refused:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds objects that torch.load(weights_only=True) "
                f"refuses ({refused[0]}); if you trust the file, pass weights_only=False"
            ) from error
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or corrupt ({type(error).__name__}: "
            f"{text.splitlines()[0] if text else ''}); it was not written by a completed td.save. "
            f"Load the previous checkpoint instead."
        ) from error


def load(path: PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """The object saved at `path`, the same on every rank (rank 0 reads it, then broadcasts).

    Every rank must call it. Tensors land on `map_location` (the CPU by default, the same on
    every rank; `model.load_state_dict` then copies them to the model's device).
    `weights_only` is passed to `torch.load`: keep it True for files you did not write.
    Raises `FileNotFoundError` (on every rank) when rank 0 has no such file, and
    `CheckpointError` naming the path when the file is truncated or not a checkpoint.
    """
    path = Path(os.fspath(path))
    if not _distributed():
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
        return _unpickle(_read_bytes(path), path, map_location, weights_only)
    data = None
    header: tuple[str | None, int] = (None, 0)
    if runtime.rank() == 0:
        try:
            data = _read_bytes(path)
            header = (None, data.numel())
        except FileNotFoundError:
            header = ("missing", 0)
        except OSError as error:
            header = (f"{type(error).__name__}: {error}", 0)
    problem, size = collectives.broadcast_object(header, root=0)
    if problem == "missing":
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} on rank 0 (rank 0 reads it for all)")
    if problem is not None:
        raise CheckpointError(f"rank 0 could not read checkpoint {str(path)!r}: {problem}")
    if data is None:
        data = torch.empty(size, dtype=torch.uint8)
    if size:
        collectives.broadcast(data, root=0, inplace=True)
    return _unpickle(data, path, map_location, weights_only)
