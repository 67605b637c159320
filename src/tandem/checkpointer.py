"""`td.Checkpointer`: periodic, crash-safe checkpoints, and the resume after a restart.

    ckpt = td.Checkpointer("checkpoints", every=100)
    start = ckpt.restore(model=model, optimizer=opt)   # 0 on a fresh start
    for step in range(start, steps):
        train_step(step)
        ckpt.save(step, model=model, optimizer=opt)    # writes after every 100th step

`save(step, ...)` is called after every step and writes only after every `every`-th one: the
state dicts of the objects, and the number of completed steps, go to
`checkpoints/step-00000100.pt` through `td.save` (rank 0 writes a temporary file, fsyncs it and
renames it into place, so a crash at any moment leaves the previous checkpoint intact). The
`keep` newest files are kept. `restore(...)` finds the newest checkpoint (rank 0 looks, every
rank loads the same bytes), loads each state dict into its object and returns the step to
resume at. Every rank calls both, as with `td.save`/`td.load`.

With `tandem run --max-restarts K` a job that loses a rank is restarted from the top of the
script: `restore` then picks up where the last checkpoint left off. For the run to continue
exactly as an uninterrupted one, everything random must come from the step: draw the data
order from `(seed, epoch)` (`td.partition_dataset` does, with `loader.set_epoch`) and seed
per-step randomness from the step number; `TANDEM_RESTART` (0, 1, ...) tells a script which
attempt it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tandem import runtime
from tandem.checkpoint import CheckpointError, load, save
from tandem.comm import collectives

_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def _distributed() -> bool:
    return runtime.is_initialized() and runtime.size() > 1


def _stateful(name: str, obj: Any) -> Any:
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise TypeError(
            f"{name}={type(obj).__name__} has no state_dict()/load_state_dict(); pass models, "
            f"optimizers, schedulers or other objects that have them (save plain values with "
            f"td.save)"
        )
    return obj


class Checkpointer:
    """Saves `every` steps into `directory`, keeps the `keep` newest, restores the newest."""

    def __init__(self, directory: str | os.PathLike, every: int = 1, keep: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: give a positive number of steps between saves")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.directory = Path(os.fspath(directory))
        self.every = every
        self.keep = keep
        # Every rank may create it: rank 0 writes, and on a shared file system this is one dir.
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, completed: int) -> Path:
        return self.directory / f"step-{completed:08d}.pt"

    def _on_disk(self) -> list[int]:
        """Completed-step counts of the checkpoints rank 0 sees, newest first."""
        found = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_file():
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def checkpoints(self) -> list[int]:
        """The completed-step counts of the checkpoints on rank 0, newest first (every rank)."""
        mine = self._on_disk() if not _distributed() or runtime.rank() == 0 else None
        if _distributed():
            mine = collectives.broadcast_object(mine, root=0)
        return mine

    def save(self, step: int, **objects: Any) -> bool:
        """After step `step` (0-based): write a checkpoint if it completes `every` steps.

        Returns True when a checkpoint was written. Every rank must call it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: give the 0-based index of the step just finished")
        if not objects:
            raise ValueError("nothing to save: pass the objects, e.g. save(step, model=model)")
        completed = step + 1
        if completed % self.every:
            return False
        states = {name: _stateful(name, obj).state_dict() for name, obj in objects.items()}
        save({"completed": completed, "state": states}, self.path(completed))
        if not _distributed() or runtime.rank() == 0:
            for old in self._on_disk()[self.keep:]:
                try:
                    self.path(old).unlink()
                except FileNotFoundError:
                    pass
        return True

    def restore(self, **objects: Any) -> int:
        """Load the newest checkpoint into `objects`; return the step to resume at (0: none).

        A checkpoint that cannot be read (it should not happen with atomic saves, but disks
        fail) is skipped for the one before it, with a warning on rank 0.
        """
        for name, obj in objects.items():
            _stateful(name, obj)
        for completed in self.checkpoints():
            try:
                saved = load(self.path(completed))
            except (CheckpointError, FileNotFoundError) as error:
                if not _distributed() or runtime.rank() == 0:
                    print(f"tandem: skipping unreadable checkpoint {self.path(completed)}: {error}")
                continue
            missing = sorted(set(objects) - set(saved["state"]))
            if missing:
                raise KeyError(
                    f"checkpoint {self.path(completed)} has no state for {missing}; it holds "
                    f"{sorted(saved['state'])}: restore the names you saved"
                )
            for name, obj in objects.items():
                obj.load_state_dict(saved["state"][name])
            return int(saved["completed"])
        return 0
