"""One running job per checkpoint directory: the owner file, and who may take it over.

Two jobs saving into one directory interleave their checkpoints, and a restart of either
resumes the other's. So rank 0 of the job that saves (or restores) first leaves an owner file,

    <directory>/.tandem-owner     {"job": ..., "host": ..., "pid": ..., "started": ..., "since": ...}

and a job that finds another *running* job's file there is refused, with that job named. The
job is the launcher's (`environments.job_id`: tandem run's and torchrun's run id, SLURM's job
and step, Open MPI's namespace), else this process. Resuming is the normal case and stays
free: a restart of the same job takes the file over, and so does any job once the owner has
stopped: its Checkpointer was released (garbage collected, interpreter exit: the file goes),
its process is gone (same host: the pid, with its start time, so a reused pid is not mistaken
for it), or, on another host, its heartbeat (the file's modification time, touched every
`HEARTBEAT_S` by a thread of the owner) is older than `LEASE_S`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tandem import runtime
from tandem.job.environments import adapters

OWNER = ".tandem-owner"
HEARTBEAT_S = 30.0
LEASE_S = 180.0

_lock = threading.Lock()
_held: dict[Path, tuple[set[int], threading.Event]] = {}  # directory: (holders, stop its beat)


def job_id() -> str:
    """This job's name: the launcher's, else this process's (rank 0 is the only one that asks)."""
    if runtime.is_initialized():
        found = adapters.job_id(runtime.state().job.source, os.environ)
        if found:
            return found
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _started(pid: int) -> str | None:
    """A process's start time (Linux: ticks since boot), None where unknown or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"job": job_id(), "host": socket.gethostname(), "pid": pid, "started": _started(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _running(owner: dict[str, Any], file: Path) -> bool:
    if owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, TypeError, ValueError):
            pass  # another user's process, or a file that says nothing: the heartbeat decides
        else:
            started = _started(int(pid))
            if started is None:  # a zombie (Linux), or no /proc to tell by: alive unless Linux
                return not Path("/proc/self/stat").exists()
            return started == owner.get("started")
    try:
        return time.time() - file.stat().st_mtime < LEASE_S
    except OSError:
        return False


def _read(file: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _write(file: Path, owner: dict[str, Any]) -> None:
    temporary = file.with_name(f"{file.name}.{os.getpid()}")
    temporary.write_text(json.dumps(owner))
    os.replace(temporary, file)


def refusal(directory: Path, owner: dict[str, Any]) -> str:
    lapse = ""
    if owner.get("host") != socket.gethostname():
        lapse = (f"; if it is not running any more, its claim lapses {LEASE_S:.0f} s after its "
                 f"last heartbeat")
    return (f"checkpoint directory {str(directory)!r} belongs to another running job: job "
            f"{owner.get('job')!r} (rank 0 is pid {owner.get('pid')} on {owner.get('host')}, "
            f"saving there since {owner.get('since')}). Two jobs saving into one directory "
            f"interleave their checkpoints, and a restart of either resumes the other's: give this "
            f"job a directory of its own, or stop that job first{lapse} (or remove "
            f"{str(directory / OWNER)!r} if you know it has stopped)")


def claim(directory: Path, holder: int) -> str | None:
    """Rank 0: take `directory` for this job (again: every save asks), or the reason why not."""
    file = directory / OWNER
    with _lock:
        owner = _read(file)
        me = _me()
        ours = owner is not None and owner.get("job") == me["job"]
        if owner is not None and not ours and _running(owner, file):
            return refusal(directory, owner)
        if not (ours and owner.get("pid") == me["pid"]):
            _write(file, me)  # new, or taken over from a stopped job or an earlier attempt
        holders, _ = _held.get(directory) or _start_heartbeat(directory)
        holders.add(holder)
    return None


def _start_heartbeat(directory: Path) -> tuple[set[int], threading.Event]:
    stop = threading.Event()
    _held[directory] = (set(), stop)
    threading.Thread(target=_beat, args=(directory / OWNER, stop), daemon=True,
                     name="tandem-checkpoint-owner").start()
    return _held[directory]


def _beat(file: Path, stop: threading.Event) -> None:
    """Touch the owner file while it is ours, so another host sees this job is alive."""
    while not stop.wait(HEARTBEAT_S):
        owner = _read(file)
        if owner is None or owner.get("pid") != os.getpid():
            return
        try:
            os.utime(file)
        except OSError:
            return


def release(directory: Path, holder: int) -> None:
    """`holder` is done with `directory`; the last holder in this process removes the file."""
    with _lock:
        holders, stop = _held.get(directory, (set(), None))
        holders.discard(holder)
        if holders or stop is None:
            return
        del _held[directory]
        stop.set()
        owner = _read(directory / OWNER)
        if owner is not None and owner.get("pid") == os.getpid():
            try:
                (directory / OWNER).unlink()
            except OSError:
                pass
