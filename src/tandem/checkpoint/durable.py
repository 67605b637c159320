"""What the checkpoint modules share: their errors, making a rename durable, naming a full disk."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are damaged (missing, truncated, or bytes that fail their checksum)."""


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


def free_bytes(directory: Path) -> int | None:
    """Bytes free to this process in `directory`'s file system (None: cannot tell)."""
    for place in (directory, *directory.parents):
        try:
            return shutil.disk_usage(place).free
        except OSError:
            continue  # not created yet: its parent's file system is the one
    return None


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def no_space(error: BaseException, directory: Path, needed: int) -> str | None:
    """A full disk, said plainly, when `error` (or what it wraps) is one; else None.

    torch.save reports a failed write as "unexpected pos 704 vs 598"; the OSError(ENOSPC) it
    hit is only in the exception's context, so the chain is searched, and a write that failed
    with the disk (nearly) full counts as one too.
    """
    seen, link, full = set(), error, False
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        full = full or (isinstance(link, OSError) and link.errno in _FULL)
        link = link.__cause__ or link.__context__
    free = free_bytes(directory)
    if not full and (free is None or free >= max(needed, 1 << 20)):
        return None
    where = f"{str(directory)!r}: {free} bytes free" if free is not None else repr(str(directory))
    return (f"no space left on device in {where}, and this rank's part of the checkpoint needs at "
            f"least {needed} bytes ({type(error).__name__}: {error}); free space there, keep fewer "
            f"checkpoints (keep=) or save to another file system")


def needed_bytes(plan) -> int:
    """The bytes a rank's DCP save plan writes, at least (torch.save adds its framing)."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            sizes, dtype = item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype
            count = 1
            for size in sizes:
                count *= int(size)
            total += count * dtype.itemsize
        elif item.bytes_io_data is not None:
            total += int(item.bytes_io_data.nbytes)
    return total


def place(directory: Path) -> tuple[str, int | None, int | None]:
    """(host, file system id, bytes free) where `directory` is: ranks that share a place
    share its free space."""
    import socket

    try:
        device = os.stat(directory).st_dev
    except OSError:
        device = None
    return socket.gethostname(), device, free_bytes(directory)


def shortfall(directory: Path, plans: list, places: list[tuple]) -> str | None:
    """The first file system that cannot hold what its ranks are about to write (rank 0, with
    every rank's plan after deduplication), before anything is written."""
    groups: dict[tuple, list[int]] = {}
    for rank, (host, device, _) in enumerate(places):
        groups.setdefault((host, device), []).append(rank)
    for (host, _), ranks in groups.items():
        free = places[ranks[0]][2]
        needed = sum(needed_bytes(plans[r]) for r in ranks)
        if free is not None and needed > free:
            return (f"no space left on device: rank(s) {ranks} on {host} write at least {needed} "
                    f"bytes into {str(directory)!r}, which has {free} bytes free; free space there, "
                    f"keep fewer checkpoints (keep=) or save to another file system. Nothing was written")
    return None
