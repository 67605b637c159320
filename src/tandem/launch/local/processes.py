"""Local rank processes: start them, signal their process groups, stop them within a deadline.

The one place tandem starts ranks on this machine: `tandem run`'s agents (`launch.local.ranks`)
and the worker pool under `td.spawn` and the test harness (`launch.local.pool`) all call
`start_ranks`. Every rank runs in a session of its own (`start_new_session=True`), so its pid
is also its process group id, and it and any children it starts can be signalled as a whole
(`signal_group`). Stopping is the polite signal, a grace to exit, then SIGKILL
(`stop_processes`); every wait has a deadline. No torch, no tandem runtime: stdlib only.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

STOP_GRACE_S = 2.0  # between the polite signal and SIGKILL; the contract stops a job in 5 s
KILL_WAIT_S = 5.0  # after SIGKILL, how long a rank may take to disappear


def exit_code(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """`exit code 3`, or `killed by SIGKILL (exit code 137)`."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} (exit code {exit_code(returncode)})"


def start_failure_code(error: OSError) -> int:
    """The exit code a shell gives a command the system refused: 127 not found, else 126."""
    return 127 if error.errno == errno.ENOENT else 126


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, so taskset/cgroups count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def signal_group(pid: int, signum: int) -> None:
    """Signal the process group a rank leads (its pid: it started a session); gone is fine."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def start_ranks(command: Sequence[str], envs: Sequence[Mapping[str, str]]) -> list[subprocess.Popen]:
    """Start `command` once per environment in `envs`, each in a session of its own, its
    stdout and stderr piped to us (`output.RankOutput` copies them) and its standard input
    closed: ranks never read the terminal. When the system refuses to start one (the `OSError`
    is raised), those already started are killed first."""
    started: list[subprocess.Popen] = []
    try:
        for env in envs:
            started.append(subprocess.Popen(
                list(command), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            ))
    except BaseException:
        stop_processes(started, signal.SIGKILL, grace=0)  # none of a half-started job lives on
        raise
    return started


def wait_all(processes: Sequence[subprocess.Popen], timeout: float) -> list[subprocess.Popen]:
    """Wait until every process has exited, `timeout` seconds at most; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = []
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            alive.append(process)
    return alive


def stop_processes(
    processes: Sequence[subprocess.Popen],
    signum: int = signal.SIGTERM,
    grace: float = STOP_GRACE_S,
) -> list[subprocess.Popen]:
    """`signum` to each process group, SIGKILL to what is left after `grace`; then reap.

    Returns the processes that did not exit even `KILL_WAIT_S` after SIGKILL (stuck in the
    kernel); the caller says so. Their groups are killed in any case, children included.
    """
    for process in processes:
        if process.poll() is None:
            signal_group(process.pid, signum)
    alive = wait_all(processes, grace) if grace > 0 else list(processes)
    for process in processes:  # the rank's own children too, even when the rank is gone
        signal_group(process.pid, signal.SIGKILL)
    return wait_all(alive, KILL_WAIT_S)


def tcp_sockets(port: int, state: str = "01", end: int = 2) -> set[str]:
    """This machine's TCP sockets (IPv4 and IPv6) in `state` (01: established, 0A: listening)
    whose address `end` (1: local, 2: remote) has `port`, as `socket:[inode]` links."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode (the 10th)
            if len(fields) > 9 and fields[3] == state and \
                    int(fields[end].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def groups_connected_to(groups: set[int], port: int) -> set[int]:
    """Which of these process groups hold a TCP connection to `port` (any process in them)."""
    links = tcp_sockets(port)
    found: set[int] = set()
    if not links:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as file:
                group = int(file.read().rsplit(")", 1)[1].split()[2])  # state, ppid, pgrp
            if group not in groups or group in found:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in links:
                    found.add(group)
                    break
        except (OSError, ValueError, IndexError):
            continue  # gone, or not ours to read
    return found
