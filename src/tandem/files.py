"""What the checkpoint modules share: their error, and making a rename durable."""

from __future__ import annotations

import os
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def fsync_directory(directory: Path) -> None:
    """Make the renames inside `directory` durable (where the platform allows it)."""
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
