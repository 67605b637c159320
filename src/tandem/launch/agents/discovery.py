"""`--host-discovery-script`: run it once, read what it offers, or say what was wrong with it.

The script prints one line a host, `host:slots` (`host` alone is one slot), horovodrun's
format, and exits 0; a host listed twice has the sum of its slots. `discover` runs it in a
session of its own and, when it runs past its timeout (`--discovery-timeout`, else
`DEFAULT_TIMEOUT_S`), kills the whole session, so a script whose `sleep`, `ssh` or `curl` child
hangs leaves nothing behind. What it printed is all or nothing: one line that is not
`host:slots` (a traceback, a log line, a negative count) makes the whole run junk, named with
the line, rather than an offer of a host called `Traceback`.

What a bad run means is the caller's: before the job starts, `tandem run` refuses a script that
cannot run, exits non-zero, prints junk or hangs (`elastic_options.discovery_problem`:
nothing has started, so nothing is lost); once the job runs, the agent (`elastic.Rounds`)
names it once and goes on with what it has.
"""

from __future__ import annotations

import os
import signal
import subprocess

DEFAULT_TIMEOUT_S = 10.0  # a run that takes longer is killed (with its children) and named
_SHOWN = 80  # characters of a junk line or of the script's stderr quoted in a message

__all__ = ["DEFAULT_TIMEOUT_S", "discover", "read_offer"]


def discover(script: str, timeout: float | None = None) -> tuple[dict[str, int] | None, str | None]:
    """The slots `script` offers, by host: ({host: slots}, None), or (None, what was wrong)."""
    limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
    try:
        process = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as error:
        return None, f"could not run it: {error.strerror or error}"
    try:
        out, err = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_session(process)
        return None, (f"it ran longer than {limit:g} s and was killed (with its children): make "
                      "it answer sooner, or give --discovery-timeout S")
    if process.returncode != 0:
        if process.returncode < 0:
            how = f"it was killed by {signal.Signals(-process.returncode).name}"
        else:
            how = f"it exited {process.returncode}"
        last = err.strip().splitlines()[-1][:_SHOWN] if err.strip() else ""
        return None, f"{how}{f' ({last})' if last else ''}: it must exit 0"
    return read_offer(out)


def read_offer(text: str) -> tuple[dict[str, int] | None, str | None]:
    """A discovery script's output -> ({host: slots}, None), or (None, the first junk line)."""
    slots: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, sep, count = line.rpartition(":") if ":" in line else (line, "", "1")
        try:
            value = int(count)
        except ValueError:
            value = -1
        if not host or any(c.isspace() for c in line) or value < 0 or (sep and not count):
            return None, (f"line {number} is {line[:_SHOWN]!r}, not `host:slots`: it must print "
                          "one `host:slots` line a host (e.g. node1:4) and nothing else (log to "
                          "stderr)")
        slots[host] = slots.get(host, 0) + value
    return slots, None


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the script and everything it started (its session), and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    for pipe in (process.stdout, process.stderr):  # a child that left the session may hold them
        if pipe is not None:
            pipe.close()
    process.wait()
