"""The step directories of a `Checkpointer`: which exist, which go, and what to say when the
newest is damaged (the older ones a user can fall back to, by moving it away)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tandem.checkpoint import dcp_files as files
from tandem.checkpoint.durable import CheckpointError, CorruptCheckpointError

NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")  # a file, or a sharded checkpoint's directory


def damaged(error: CorruptCheckpointError, path: Path, steps: list[int]) -> str:
    older = steps[1:]
    fix = (f"the directory also holds step(s) {', '.join(map(str, older))}: move {path.name} out "
           f"of {str(path.parent)!r} to resume from step {older[0]}" if older else
           f"no older checkpoint is in {str(path.parent)!r}: bring back an intact copy of "
           f"{path.name}, or start afresh in another directory")
    return (f"{error}. This is the newest checkpoint, step {int(path.name[5:])}; {fix} (tandem "
            f"never falls back to an older checkpoint on its own)")


def on_disk(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in directory.iterdir():
        match = NAME.match(entry.name)
        if not match:
            continue
        if entry.is_dir() and not (entry / files.METADATA).is_file():
            raise CheckpointError(
                f"checkpoint directory {str(entry)!r} has no {files.METADATA} (its save did "
                f"not complete, or files were removed): move it away or restore its files; "
                f"tandem neither skips nor overwrites it")
        found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def prune(directory: Path, keep: int, latest: Path) -> None:
    """Rank 0, once `latest` is published: its crashed saves' leftovers, and all but the `keep`
    newest checkpoints."""
    files.remove_leftovers(latest)
    try:
        found = on_disk(directory)
    except CheckpointError:
        return  # a directory without metadata: the next save or restore names it
    for _, old in found[keep:]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
