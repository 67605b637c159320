"""The last async checkpoint is published when the script ends without `wait()`.

`Checkpointer(async_save=True)` publishes a save at the next `save`, `restore` or `wait()`. A
script that ends after its last `save` (or calls `td.shutdown()` first) would leave that
checkpoint unpublished, and a restart would resume an older one. So every async save in flight
is kept here until it is published, and an exit hook publishes what is left: through the files,
not the engine (it may be shut down, and no collective may hang an exit): each rank marks its
files done, rank 0 waits for every mark until the job's timeout (`TANDEM_TIMEOUT`) and
publishes. A save that cannot be published is said loudly on stderr, naming the step lost and
the step a restart resumes from.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from pathlib import Path

from tandem.checkpoint import dcp_files as files

# id(pending save): (the save, its step, what to do once it is published)
_unpublished: dict[int, tuple[files.PendingSave, int, Callable[[], None]]] = {}


def track(pending: files.PendingSave, completed: int, after: Callable[[], None]) -> None:
    """Keep `pending` until `done(pending)`; publish it at exit otherwise."""
    _unpublished[id(pending)] = (pending, completed, after)
    # After td.init's own exit hook (registered at init), so this one runs first: LIFO.
    atexit.unregister(publish_at_exit)
    atexit.register(publish_at_exit)


def done(pending: files.PendingSave) -> None:
    _unpublished.pop(id(pending), None)


def publish_at_exit(deadline_s: float | None = None) -> list[str]:
    """Publish every save still in flight (every rank calls it: the exit hook); returns and
    prints what could not be published."""
    lost = []
    for key, (pending, completed, after) in list(_unpublished.items()):
        del _unpublished[key]
        try:
            problem = pending.finish_through_files(
                files.runtime_timeout() if deadline_s is None else deadline_s)
        except Exception as error:  # noqa: BLE001 - an exit hook reports, never raises
            problem = f"{type(error).__name__}: {error}"
        if problem is None:
            if pending.rank == 0:
                after()
            continue
        lost.append(_warning(pending.path, completed, problem))
        print(lost[-1], file=sys.stderr, flush=True)
    return lost


def _warning(path: Path, completed: int, problem: str) -> str:
    steps = sorted((int(p.name[5:]) for p in path.parent.glob("step-*")
                    if p.name[5:].isdigit() and p.is_dir()), reverse=True)
    resume = (f"a restart resumes from step {steps[0]}, the newest published in "
              f"{str(path.parent)!r}" if steps else "a restart starts from step 0")
    return (f"tandem: WARNING: the checkpoint of step {completed} ({str(path)!r}) was NOT "
            f"published at exit: {problem}. {resume}. Call checkpointer.wait() after the last "
            f"save to publish it (or see why it fails) while the job still runs")
