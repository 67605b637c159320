"""Local rank processes: start them, signal their process groups, stop them within a deadline.

The one place tandem starts ranks on this machine: `tandem run`'s agents (`launch.ranks`),
`td.spawn` (`tandem.spawning`) and the test harness (`tandem.testing.LocalWorld`) all call
`start_ranks`. Every rank runs in a session of its own (`start_new_session=True`), so its pid
is also its process group id, and it and any children it starts can be signalled as a whole
(`signal_group`). Stopping is the polite signal, a grace to exit, then SIGKILL
(`stop_processes`); every wait has a deadline. No torch, no tandem runtime: stdlib only.
"""

from __future__ import annotations

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


def start_ranks(
    command: Sequence[str],
    envs: Sequence[Mapping[str, str]],
    *,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    pass_fds=(),
) -> list[subprocess.Popen]:
    """Start `command` once per environment in `envs`, each in a session of its own.

    `stdout`/`stderr` are what `subprocess.Popen` takes: pipes by default (the agent prefixes
    each line), None to share ours, a file; `pass_fds`, descriptors the rank inherits. Each
    may also be a callable `rank -> value` (one log file, one pipe per rank). Standard input is
    closed: ranks never read the terminal.
    """
    def each(value, rank: int):
        return value(rank) if callable(value) else value

    return [
        subprocess.Popen(
            list(command), env=dict(env), stdin=subprocess.DEVNULL, stdout=each(stdout, rank),
            stderr=each(stderr, rank), pass_fds=each(pass_fds, rank), start_new_session=True,
        )
        for rank, env in enumerate(envs)
    ]


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
