"""What the engine was given at `td.init`: the backend, the timeout, the checks, this process's place.

comm sits below the runtime: it never reads `tandem.runtime`'s globals. `runtime.init` builds
the backend and hands comm its state with `install`; `runtime.shutdown` takes it back with
`clear`. Everything in comm that needs "the current engine" (groups, the collectives, the
argument check, the agreement primitive) asks `current()`. The object installed is the
runtime's own state, so a setting changed there (`runtime.state().checks = False`) is the one
comm sees: there is one truth, owned by the runtime and read here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.comm.engines.backend import Backend


class Place(Protocol):
    """This process's place in the job: what comm reads of `runtime.World`."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


class Context(Protocol):
    """What comm is given: satisfied by `runtime.RuntimeState`."""

    world: Place
    backend: Backend
    timeout: float
    checks: bool
    debug: bool


#: The installed context, or None: what `current()` returns, read directly by the few calls
#: that must cost nothing above the wire (a small `td.allreduce`); everything else calls
#: `current()`, which explains a missing `td.init`.
active: Context | None = None
_was_shut_down = False


def install(context: Context) -> None:
    """Make `context` the engine every comm call uses (called by `td.init`)."""
    global active, _was_shut_down
    active = context
    _was_shut_down = False


def clear() -> None:
    """Forget the engine (called by `td.shutdown`)."""
    global active, _was_shut_down
    _was_shut_down = active is not None
    active = None


def installed() -> bool:
    """Whether `td.init` has installed an engine (and `td.shutdown` not yet taken it back)."""
    return active is not None


def current() -> Context:
    """The installed context; a clear error when `td.init` has not been called."""
    context = active
    if context is None:
        if _was_shut_down:
            raise RuntimeError("tandem was shut down (td.shutdown() was called): no collective "
                               "can run after it; call td.init() again first, or move the call "
                               "before td.shutdown()")
        raise RuntimeError("tandem is not initialised: call td.init() first")
    return context

