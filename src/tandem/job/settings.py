"""What this process was told: every `TANDEM_*` setting, parsed and checked here, read once.

    from tandem.job import settings
    settings.current().timeout_s        # TANDEM_TIMEOUT, else DEFAULT_TIMEOUT_S

`current()` reads the environment the first time it is called and returns the same frozen
`Settings` ever after; `reload()` reads it again (tests that change the environment call it).
`read(env)` parses any mapping without touching the cache. A value that cannot be used is a
`ValueError` naming the variable, the value and what to write instead.

Also here, because the launcher and the rank must agree on them: the backend names, the one
timeout default, and `choose_backend`, the one backend choice (DESIGN section 1). This module
imports nothing but the standard library, so the `tandem` command can use it without torch.
The variables that say where a rank sits in its job (`TANDEM_RANK`...) are job discovery, not
settings: `environments.py` reads those. `tandem run`'s own options (`TANDEM_NP`...) are read
with its flags, in `launch/config.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

BACKENDS = ("gloo", "nccl", "mpi")
DEFAULT_TIMEOUT_S = 300.0  # how long any rendezvous or collective may wait, unless told
DEFAULT_TIMELINE_EVENTS = 200_000  # per rank, in the timeline's ring buffer
MPI_PROGRESS_MODES = ("auto", "thread", "none")
MPI_ON_FAILURE = ("abort", "exit", "shrink")  # shrink: ULFM, launch/mpi/shrinking.py
SCALE_MODES = ("strong", "weak")
_FALSE = ("0", "false", "no", "off")


def check_backend(name: str, where: str = "") -> str:
    """`name` lower-cased when it is one of `BACKENDS`; else a ValueError naming the choices."""
    backend = name.strip().lower()
    if backend not in BACKENDS:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def choose_backend(named: str | None, *, cuda: bool, mpi: bool, mpi_job: bool) -> str:
    """The backend of a job, the same for `tandem run` and for every rank (DESIGN section 1).

    The one named (`backend=`, `--backend`, `TANDEM_BACKEND`); else `nccl` with CUDA; else
    `mpi` when the job can run on it; else `gloo`. The inputs are passed in, so that the
    launcher needs no torch to ask: `cuda`, CUDA is available; `mpi`, mpi4py is installed (and,
    for the launcher, an mpiexec to start the ranks); `mpi_job`, the ranks are, or will be,
    started by mpiexec: a rank started by mpiexec, or a `tandem run` job MPI can run (one local
    agent without restarts). A named `nccl` without CUDA is an error, not a silent fallback.
    """
    if named:
        name = check_backend(named)
        if name == "nccl" and not cuda:
            raise ValueError("backend 'nccl' needs CUDA, and no GPU is visible: use 'gloo'")
        return name
    if cuda:
        return "nccl"
    if mpi and mpi_job:
        return "mpi"
    return "gloo"


@dataclass(frozen=True)
class Settings:
    """Every `TANDEM_*` setting of this process, parsed (the variable in each comment)."""

    backend: str | None = None  # TANDEM_BACKEND: gloo | nccl | mpi; None: choose_backend
    timeout: float | None = None  # TANDEM_TIMEOUT (seconds); None: DEFAULT_TIMEOUT_S
    checks: bool = True  # TANDEM_CHECKS=0: no cross-rank argument checks
    debug: bool = False  # TANDEM_DEBUG=1: per-collective fingerprints
    watchdog: bool = True  # TANDEM_WATCHDOG=0: no watchdog
    timeline: str | None = None  # TANDEM_TIMELINE: the trace file
    timeline_events: int = DEFAULT_TIMELINE_EVENTS  # TANDEM_TIMELINE_EVENTS
    restart: int = 0  # TANDEM_RESTART: which attempt of a restarted job this is
    mpi_progress: str = "auto"  # TANDEM_MPI_PROGRESS: auto | thread | none
    mpi_on_failure: str = "abort"  # TANDEM_MPI_ON_FAILURE: abort | exit | shrink
    mpi_cuda_aware: bool | None = None  # TANDEM_MPI_CUDA_AWARE; None: ask the library
    launch_token: str | None = None  # TANDEM_LAUNCH_TOKEN: an MPI rank's proof to its agent
    scale_steps: int | None = None  # TANDEM_SCALE_STEPS (tandem scale)
    scale_warmup: int = 0  # TANDEM_SCALE_WARMUP
    scale_out: str | None = None  # TANDEM_SCALE_OUT
    scale_mode: str = "strong"  # TANDEM_SCALE_MODE: strong | weak
    terminal: bool = False  # TANDEM_TERMINAL=1: `tandem run` shows this rank's stderr on a terminal

    @property
    def timeout_s(self) -> float:
        """The timeout in seconds: TANDEM_TIMEOUT, else `DEFAULT_TIMEOUT_S`."""
        return DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout


def _text(env: Mapping[str, str], name: str) -> str | None:
    """TANDEM_<name> stripped, or None when unset or empty."""
    value = env.get(f"TANDEM_{name}")
    return value.strip() if value is not None and value.strip() else None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = _text(env, name)
    return default if text is None else text.lower() not in _FALSE


def _number(env: Mapping[str, str], name: str, kind, minimum=None, default=None):
    text = _text(env, name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"TANDEM_{name}={text!r} is not {noun}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"TANDEM_{name}={value}: give an integer >= {minimum}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = (_text(env, name) or default).lower()
    if value not in choices:
        raise ValueError(f"TANDEM_{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def read(env: Mapping[str, str] | None = None) -> Settings:
    """Parse the `TANDEM_*` settings of `env` (default `os.environ`); nothing is cached."""
    env = os.environ if env is None else env
    backend = _text(env, "BACKEND")
    timeout = _number(env, "TIMEOUT", float)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"TANDEM_TIMEOUT={timeout:g}: give a positive number of seconds")
    cuda_aware = _text(env, "MPI_CUDA_AWARE")
    if _text(env, "SCALE_STEPS") and not _text(env, "SCALE_OUT"):
        raise ValueError("TANDEM_SCALE_STEPS is set but TANDEM_SCALE_OUT is not: "
                         "set both (tandem scale does), or neither")
    return Settings(
        backend=check_backend(backend, f"TANDEM_BACKEND={backend!r}") if backend else None,
        timeout=timeout,
        checks=_flag(env, "CHECKS", True),
        debug=_flag(env, "DEBUG", False),
        watchdog=_flag(env, "WATCHDOG", True),
        timeline=_text(env, "TIMELINE"),
        timeline_events=_number(env, "TIMELINE_EVENTS", int, 1, DEFAULT_TIMELINE_EVENTS),
        restart=_number(env, "RESTART", int, 0, 0),
        mpi_progress=_choice(env, "MPI_PROGRESS", MPI_PROGRESS_MODES, "auto"),
        mpi_on_failure=_choice(env, "MPI_ON_FAILURE", MPI_ON_FAILURE, "abort"),
        mpi_cuda_aware=None if cuda_aware is None else cuda_aware.lower() not in _FALSE,
        launch_token=_text(env, "LAUNCH_TOKEN"),
        scale_steps=_number(env, "SCALE_STEPS", int, 1),
        scale_warmup=_number(env, "SCALE_WARMUP", int, 0, 0),
        scale_out=_text(env, "SCALE_OUT"),
        scale_mode=_choice(env, "SCALE_MODE", SCALE_MODES, "strong"),
        terminal=_flag(env, "TERMINAL", False),
    )


_current: Settings | None = None


def current() -> Settings:
    """This process's settings, read from `os.environ` on first use."""
    global _current
    if _current is None:
        _current = read()
    return _current


def reload() -> Settings:
    """Read `os.environ` again (after a test changed it); later `current()` calls see this."""
    global _current
    _current = None
    return current()
