"""tandem's torch.distributed backends, named to torch as soon as torch is there, without
importing torch ourselves and without loading tandem's engines before they are used.

Two ways in:

- **`import torch` alone** (no `import tandem`): torch >= 2.5 calls every entry point of the
  group "torch.backends" at the end of its own import (`torch._import_device_backends`);
  tandem's (pyproject.toml) is `autoload` below, so `dist.init_process_group("mpi")` and
  `init_process_group("tandem")` work in any interpreter of an environment where tandem is
  installed. `TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns torch's autoloading off (tandem's too).
- **`import tandem`** calls `install()`: with torch already imported it names the backends now;
  otherwise `after_import` does it right after torch's module has run.

Either way `name_backends()` only tells torch the names: "tandem" through
`Backend.register_backend`, "mpi" through the two names torch reads for its own MPI build
(`_MPI_AVAILABLE`, `ProcessGroupMPI`, where torch has none: at once in a process an MPI
launcher started, else when `init_process_group` asks for "mpi"), and a first-call wrapper on
`init_process_group`. Each of these loads `comm.torch_pg.register` (the engines, the watchdog,
the agreement) on its first use and hands over to it; an interpreter that never starts a group
pays a few microseconds and three small modules. Nothing here may raise: an error in an entry
point makes `import torch` itself fail, so it is a warning. Standard library only at import
(STYLE.md's "no import-time side effects", with the exception issue 27 asks for).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

from tandem.hooks.after_import import after_import

TARGET = "torch"
UNWRAPPED = "tandem_unwrapped"  # torch's own init_process_group, on the first-call wrapper


def _full() -> Any:
    """Load tandem's backends proper (idempotent) and return their module."""
    from tandem.comm.torch_pg import register

    register.register()
    return register


def _create_tandem(options: Any, backend_options: Any = None) -> Any:
    return _full().create_tandem(options, backend_options)


class FirstUseMPI:
    """Stands in for torch's `ProcessGroupMPI` until tandem's is loaded (`TandemMPI`)."""

    @staticmethod
    def create(ranks: list[int]) -> Any:
        return _full().TandemMPI.create(ranks)


def _name_mpi(c10d: Any) -> None:
    """torch's own two names for its MPI build, where it has none: tandem's stands in."""
    if not c10d.is_mpi_available():
        c10d.ProcessGroupMPI = FirstUseMPI
        c10d._MPI_AVAILABLE = True


def _asks_for_mpi(args: tuple, kwargs: dict) -> bool:
    backend = kwargs.get("backend", args[0] if args else None)
    return backend is not None and "mpi" in str(backend).lower()


def name_backends(mpi_now: bool = True) -> None:
    """Tell torch.distributed the names "tandem" and "mpi"; their code loads on first use.

    `mpi_now=False` (a process no MPI launcher started): "mpi" is named when
    `init_process_group` asks for it, not before, so that `dist.is_mpi_available()` stays what
    torch says until then (see `_MPI_LAUNCHED`)."""
    import torch.distributed as dist

    if not dist.is_available():
        return  # a torch built without distributed support: nothing to register with
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    if "tandem" not in dist.Backend.backend_list:
        dist.Backend.register_backend("tandem", _create_tandem, extended_api=True,
                                      devices=["cpu", "cuda"])
    if mpi_now:
        _name_mpi(c10d)
    loaded = sys.modules.get("tandem.comm.torch_pg.register")
    if not hasattr(dist.init_process_group, UNWRAPPED) \
            and not (loaded is not None and loaded.is_registered()):
        original = dist.init_process_group

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if _asks_for_mpi(args, kwargs):
                _name_mpi(c10d)
            _full()  # replaces this wrapper with tandem's (`register.guarded_init`)
            return dist.init_process_group(*args, **kwargs)

        setattr(init_process_group, UNWRAPPED, original)
        dist.init_process_group = c10d.init_process_group = init_process_group


def register(mpi_now: bool | None = None) -> None:
    """Name the backends now; a torch without torch.distributed (or another than expected) is
    a warning, never an error."""
    try:
        name_backends(_mpi_launched() if mpi_now is None else mpi_now)
    except Exception as error:  # noqa: BLE001 - importing torch must never fail because of us
        warnings.warn(f"tandem could not register its torch.distributed backends: {error!r}",
                      stacklevel=2)


def autoload() -> None:
    """torch's "torch.backends" entry point: called at the end of `import torch`."""
    install()


# Set by every MPI launcher tandem knows (Open MPI, MPICH/Hydra, PMIx): in such a process a
# framework that asks `dist.is_mpi_available()` should hear yes. Elsewhere MPI cannot join the
# process to anything (tandem's MPI engine refuses a process its launcher did not start), so
# the answer stays torch's own until a group asks for "mpi": Accelerate, for one, takes "mpi"
# on CPU whenever it is available, and a torchrun or `tandem run --backend gloo` job of its
# would fail.
_MPI_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def _mpi_launched() -> bool:
    return any(name in os.environ for name in _MPI_LAUNCHED)


def install() -> None:
    """Register tandem's backends with torch.distributed now, or as soon as torch is imported."""
    if "torch.distributed" in sys.modules or TARGET in sys.modules:
        if TARGET in sys.modules and getattr(sys.modules[TARGET], "distributed", None) is not None:
            register(mpi_now=_mpi_launched())
        return  # torch is being imported right now: nothing safe to do but wait for a later call
    after_import(TARGET, register)
