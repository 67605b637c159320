"""MPI's shared-memory segments in /dev/shm: removed when a job ends, reported when stale.

MPICH (`mpich_shm_*`, 2 MB) and Open MPI (`sm_segment.*`, `vader_segment.*`, 16 MB) put the
ranks' shared memory in files under /dev/shm. A job whose ranks are stopped before MPI
unlinks them (a rank fails after `td.init()`, a signal, the watchdog) leaves them behind, and
on a long-lived machine they pile up until /dev/shm is full. `tandem run` notes which segments
exist before it starts mpiexec and, when the job ends for any reason, removes the new ones
that no process still maps. A `tandem run` that was itself killed (SIGKILL) cannot; so every
`tandem run` first removes the stale ones (`remove_stale`), and `tandem doctor` lists them with
the command that clears them (`tandem doctor --clean` clears them). Stale means that no process
maps the file or holds it open: a live job's segments, or one that is being created, are never
touched. Only this user's files are. tandem makes no segments of its own.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PATTERNS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*")


def segments(directory: Path = SHM_DIR) -> set[str]:
    """Names of this user's MPI segment files in `directory`."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return set()
    uid = os.getuid()
    found = set()
    for entry in entries:
        if any(fnmatch.fnmatch(entry.name, p) for p in PATTERNS):
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid and entry.is_file(follow_symlinks=False):
                    found.add(entry.name)
            except OSError:
                continue
    return found


def in_use(directory: Path = SHM_DIR) -> set[str]:
    """Names of files in `directory` that a process of this user maps or holds open."""
    prefix = str(directory).rstrip("/") + "/"
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            # Open files before maps: MPI opens a segment, maps it, then closes the file, so
            # read in this order a segment is seen at every step of that.
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix):].strip().removesuffix(" (deleted)"))
        except OSError:
            continue  # gone, or another user's
    return used


def stale(directory: Path = SHM_DIR, among: set[str] | None = None) -> list[str]:
    """This user's MPI segments (of `among`, default all) that no process maps or holds open."""
    names = segments(directory) if among is None else among
    if not names:
        return []
    used = in_use(directory)
    return sorted(n for n in names if n not in used)


def _remove(names: list[str], directory: Path) -> list[str]:
    removed = []
    for name in names:
        try:
            (directory / name).unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


def remove_new(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """After a job: remove the segments that appeared since `before` and are used by no one."""
    return _remove(stale(directory, segments(directory) - before), directory)


def remove_stale(directory: Path = SHM_DIR) -> tuple[list[str], int]:
    """Remove every stale segment of this user (killed jobs' leftovers): (names, bytes freed)."""
    names = stale(directory)
    sizes = {name: _size(directory / name) for name in names}
    removed = _remove(names, directory)
    return removed, sum(sizes[name] for name in removed)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _listing(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def describe_removed(names: list[str], size: int, directory: Path = SHM_DIR) -> str:
    """`removed 2 stale MPI segment(s) from /dev/shm (4.0 MB), left by ...: names`"""
    return (f"removed {len(names)} stale MPI segment(s) from {directory} ({size / 2**20:.1f} MB), "
            f"left by MPI jobs that were killed: {_listing(names)}")


def describe_stale(directory: Path = SHM_DIR) -> tuple[str, str] | None:
    """(what, the command to clear it) for `tandem doctor`, or None when there is nothing."""
    names = stale(directory)
    if not names:
        return None
    size = sum(_size(directory / name) for name in names)
    command = "tandem doctor --clean (removes only the segments no process uses)"
    if len(names) <= 20:
        command += ", or rm -f " + " ".join(str(directory / n) for n in names)
    return (f"{len(names)} stale MPI segment(s) in {directory} ({size / 2**20:.1f} MB): "
            f"{_listing(names)}", command)
