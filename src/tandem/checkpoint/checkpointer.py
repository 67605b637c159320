"""Checkpoints that survive crashes: `td.save`/`td.load` for one file, `td.Checkpointer` for a run.

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
memory twice; fully sharded models save one file per rank instead (`td.checkpoint.save_sharded`).

Without `td.init()` (a notebook inspecting a checkpoint) both work as a world of one.
With `ZeroOptimizer`, `opt.state_dict()` gathers the full state (a collective: every rank calls
it), so `td.save(opt.state_dict(), path)` is called on every rank, as usual.

`Checkpointer`: periodic checkpoints of a training run, and the resume after a restart.

    ckpt = td.Checkpointer("checkpoints", every=100)
    start = ckpt.restore(model=model, optimizer=opt)   # 0 on a fresh start
    for step in range(start, steps):
        train_step(step)
        ckpt.save(step, model=model, optimizer=opt)    # writes after every 100th step

`save(step, ...)` is called after every step and writes only after every `every`-th one: a
directory `checkpoints/step-00000100/` in PyTorch's DCP format (`tandem.checkpoint.sharded`):
every rank writes the pieces it holds of each model and optimizer, whatever their layout,
rank 0 the metadata last, and the directory is renamed into place (a crash at any moment
leaves the previous checkpoint intact). The `keep` newest are kept. `restore(...)` finds the
newest, checks it whole on every rank, loads it into the objects in whatever layout they now
have (any tp, pp, fully_shard or ZeRO size, or the plain model) and returns the step to resume
at. Every rank calls both. `async_save=True` blocks `save` only for the copy to host memory.

What is never loaded wrong or lost silently: each item's bytes carry a CRC-32 in the metadata,
checked before a load (`tandem.checkpoint.checksums`: a damaged file is refused naming it, the step and
the older steps); the directory belongs to one running job (`tandem.checkpoint.dir_owner`: another job's
save or restore there is refused naming it; resuming a stopped job's directory is free); an
async save still in flight when the script ends is published at exit (`tandem.checkpoint.exit`);
a full disk is named with the bytes needed and free, before writing when it can be seen.

With `tandem run --max-restarts K` a job that loses a rank is restarted from the top of the
script: `restore` then picks up where the last checkpoint left off. For the run to continue
exactly as an uninterrupted one, everything random must come from the step: draw the data
order from `(seed, epoch)` (`td.partition_dataset` does, with `loader.set_epoch`) and seed
per-step randomness from the step number; `TANDEM_RESTART` (0, 1, ...) tells a script which
attempt it is.

The data position is state like the rest: `save(step, model=..., optimizer=..., data=loader)`
with a `td.partition_dataset` loader keeps the epoch and the place in its order, and
`restore(..., data=loader)` resumes at the exact sample, on any number of ranks
(`tandem.data`). A loader without `state_dict()` (a plain `DataLoader`) is left out with one
warning: it restarts at its epoch's start.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem import runtime
from tandem.checkpoint import dcp_files as files
from tandem.checkpoint import dir_owner, steps_on_disk
from tandem.checkpoint import exit as checkpoint_exit
from tandem.checkpoint import preemption as agreed_stop
from tandem.checkpoint import sharded as sharded
from tandem.checkpoint.durable import CheckpointError, CorruptCheckpointError, no_space
from tandem.checkpoint.durable import fsync_directory as _fsync_directory
from tandem.comm.collectives import user as collectives
from tandem.data import keeps_position
from tandem.job import preemption

PathLike = str | os.PathLike

# Test hook: called with the temporary file after it is written and fsynced, just before the
# rename. The crash test sets it to SIGKILL its own process there.
_before_replace: Callable[[Path], None] | None = None


def _distributed() -> bool:
    return runtime.is_initialized() and runtime.size() > 1


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
            try:
                torch.save(obj, file)
                file.flush()
                os.fsync(file.fileno())
            except (OSError, RuntimeError) as error:  # torch.save: "unexpected pos" on a full disk
                full = no_space(error, directory, file.tell())
                if full is None:
                    raise
                raise CheckpointError(f"cannot save checkpoint {str(path)!r}: {full}") from error
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

    Args:
        obj: what to save, on rank 0 (a state dict, or anything `torch.save` accepts).
        path: the file to write; a temporary file beside it is renamed into place.

    Raises:
        CheckpointError: rank 0 could not write the file (raised on every rank, with rank 0's
            error).
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

    Args:
        path: the file `td.save` wrote.
        map_location: where the tensors land, as for `torch.load` (the CPU by default).
        weights_only: passed to `torch.load`: keep it True for files you did not write.

    Returns:
        The saved object, the same on every rank.

    Raises:
        FileNotFoundError: rank 0 has no file at `path` (on every rank).
        CheckpointError: rank 0 could not read it, the file is truncated or not a checkpoint,
            or `weights_only=True` refuses an object in it (pass weights_only=False if you
            trust the file).
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


class Checkpointer:
    """Saves `every` steps into `directory`, keeps the `keep` newest, restores the newest.

    Each checkpoint is a directory `step-<completed>` in PyTorch's Distributed Checkpoint
    format (`tandem.checkpoint.sharded`): every rank writes the pieces it holds of whatever
    layout the model has (replicated, tensor parallel, pipeline stages, fully sharded, ZeRO),
    and `restore` loads them into any other layout of the same model. With
    `async_save=True`, `save` returns once the state is copied to host memory; the files are
    written by a background thread and published at the next `save`, `restore` or `wait()`,
    or when the script ends (`tandem.checkpoint.exit`). The directory belongs to one running
    job (`tandem.checkpoint.dir_owner`): another job's `save` or `restore` there is refused while it runs.

    Args:
        directory: where the `step-<completed>` directories go (created if missing).
        every: save after every `every`-th step (a positive int).
        keep: how many of the newest checkpoints to keep (at least 1).
        async_save: return from `save` once the state is copied to host memory, writing the
            files in a background thread.

    Raises:
        ValueError: `every` or `keep` is not a positive int.
    """

    def __init__(self, directory: str | os.PathLike, every: int = 1, keep: int = 2,
                 async_save: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: give a positive number of steps between saves")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.directory = Path(os.fspath(directory))
        self.every = every
        self.keep = keep
        self.async_save = bool(async_save)
        self._pending: files.PendingSave | None = None
        self._checked = False  # the directory was looked at (later saves only add to it)
        self._pruning: threading.Thread | None = None
        # Async saves copy into the same host buffers every time (one copy of this rank's
        # state, as torch's async checkpointing keeps): reused memory copies fast.
        self._staging: dict | None = {} if self.async_save else None
        # Every rank may create it: rank 0 writes, and on a shared file system this is one dir.
        self.directory.mkdir(parents=True, exist_ok=True)
        self._owned = self.directory.resolve()
        self._holder = next(_holders)
        preemption.arm()  # SIGTERM/SIGUSR1 from now on: an agreed save and exit (see save)
        weakref.finalize(self, dir_owner.release, self._owned, self._holder)

    def path(self, completed: int) -> Path:
        return self.directory / f"step-{completed:08d}"

    def _on_disk(self) -> list[tuple[int, Path]]:
        """(completed steps, path) of the checkpoints rank 0 sees, newest first; a checkpoint
        directory without its metadata is an error, never skipped (a restart would lose it)."""
        return steps_on_disk.on_disk(self.directory)

    def _claim(self) -> str | None:
        return dir_owner.claim(self._owned, self._holder)

    def checkpoints(self, claim: bool = False) -> list[int]:
        """The completed-step counts of the checkpoints on rank 0, newest first (every rank).
        With `claim`, rank 0 also takes the directory for this job (refused: an error)."""
        mine: Any = None
        if not _distributed() or runtime.rank() == 0:
            try:
                refused = self._claim() if claim else None
                if refused:
                    raise CheckpointError(refused)
                mine = [completed for completed, _ in self._on_disk()]
            except CheckpointError as error:
                mine = error
        if _distributed():
            mine = collectives.broadcast_object(
                str(mine) if isinstance(mine, CheckpointError) else mine, root=0)
        if isinstance(mine, (str, CheckpointError)):
            raise CheckpointError(str(mine))
        return mine

    def save(self, step: int, **objects: Any) -> bool:
        """After step `step` (0-based): write a checkpoint if it completes `every` steps.

        Returns True when a checkpoint was written (or, with `async_save`, started). Every rank
        must call it. When a preemption signal reached any rank (`tandem.job.preemption`), every
        rank saves at this same step whatever `every` says, waits for the files, and raises
        `td.Preempted` (a SystemExit with status 75: resume me; under SLURM rank 0 requeues).
        Refused before anything is written when another running job saves into
        the same directory, or when the file system cannot hold the checkpoint.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: give the 0-based index of the step just finished")
        objects = _with_state(objects)
        if not objects:
            raise ValueError("nothing to save: pass the objects, e.g. save(step, model=model)")
        sharded.check_objects(objects)
        completed = step + 1
        stopping = agreed_stop.preempted()  # a preemption signal on any rank: save now, then exit
        if completed % self.every and not stopping:
            return False
        self.wait()  # a second save waits for the first
        if not self._checked:  # refuses a directory without metadata before writing beside it
            self.checkpoints(claim=True)
            self._checked = True
        pending = sharded.start_save(self.path(completed), {"completed": completed},
                                     background=self.async_save, staging=self._staging,
                                     admit=self._claim, **objects)
        self._pending = pending
        if not self.async_save or stopping:
            self.wait()
            if stopping:
                rank = runtime.rank() if _distributed() else 0
                raise preemption.stop(step, rank, f"checkpoint {self.path(completed)} saved")
        else:
            checkpoint_exit.track(pending, completed, functools.partial(
                steps_on_disk.prune, self.directory, self.keep, pending.path))
        return True

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank): its checkpoint is then on disk.
        After `td.shutdown()`, rank 0 publishes it once every rank has finished its files."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        checkpoint_exit.done(pending)
        pending.finish()
        if not _distributed() or runtime.rank() == 0:
            if self._pruning is not None:
                self._pruning.join()
            # Removing old checkpoints touches no other rank and nothing the step needs.
            self._pruning = threading.Thread(target=steps_on_disk.prune, daemon=True,
                                             args=(self.directory, self.keep, pending.path),
                                             name="tandem-checkpoint-prune")
            self._pruning.start()
            if not self.async_save:
                self._pruning.join()

    def restore(self, **objects: Any) -> int:
        """Load the newest checkpoint into `objects`, in whatever layout they now have; return
        the step to resume at (0: none). A checkpoint that cannot be read, or whose bytes fail
        their checksums, is an error that names it and the older ones (nothing is loaded),
        never skipped for an older one."""
        objects = _with_state(objects)
        if not objects:
            raise ValueError("nothing to restore: pass the objects, e.g. restore(model=model)")
        sharded.check_objects(objects)
        self.wait()
        steps = self.checkpoints(claim=True)
        for completed in steps[:1]:
            path = self.path(completed)
            if (self.directory / f"{path.name}.pt").exists():  # written by tandem before DCP
                return self._restore_file(self.directory / f"{path.name}.pt", objects)
            try:
                record = sharded.load_sharded(path, **objects)
            except CorruptCheckpointError as error:
                raise CorruptCheckpointError(steps_on_disk.damaged(error, path, steps)) from None
            return int(record.get("completed", completed))
        return 0

    @staticmethod
    def _restore_file(path: Path, objects: dict[str, Any]) -> int:
        saved = load(path)
        missing = sorted(set(objects) - set(saved["state"]))
        if missing:
            raise KeyError(f"checkpoint {path} has no state for {missing}; it holds "
                           f"{sorted(saved['state'])}: restore the names you saved")
        for name, obj in objects.items():
            obj.load_state_dict(saved["state"][name])
        return int(saved["completed"])


_holders = itertools.count()


def _with_state(objects: dict[str, Any]) -> dict[str, Any]:
    """`objects` without data loaders that keep no position (warned once per name)."""
    kept = {}
    for name, obj in objects.items():  # a loop, not a comprehension: the warning's stacklevel
        if keeps_position(name, obj):
            kept[name] = obj
    return kept
