"""tandem's torch.distributed backends, registered once torch is there, without importing it.

`import tandem` must not import torch (the `tandem` command starts without it), yet a script
that imports tandem before torch expects `dist.init_process_group("tandem")` (and "mpi") to
work. So `import tandem` calls `install()`: with torch already imported it registers the
backends now (`torch_register.register`); otherwise `import_hooks.after_import` registers
right after torch's module has run (torch imports torch.distributed itself). That finder is
the one thing `import tandem` does besides defining names: STYLE.md's "no import-time side
effects", with the exception issue 27 asks for. Standard library only.
"""

from __future__ import annotations

import sys
import warnings

from tandem.hooks.after_import import after_import

TARGET = "torch"


def register() -> None:
    """Register now; a torch without torch.distributed (or another than expected) is a warning."""
    try:
        import torch.distributed

        if not torch.distributed.is_available():
            return  # a torch built without distributed support: nothing to register with
        from tandem.comm.torch_pg.register import register as add_backends

        add_backends()
    except Exception as error:  # noqa: BLE001 - importing torch must never fail because of us
        warnings.warn(f"tandem could not register its torch.distributed backends: {error!r}",
                      stacklevel=2)


def install() -> None:
    """Register tandem's backends with torch.distributed now, or as soon as torch is imported."""
    if "torch.distributed" in sys.modules or TARGET in sys.modules:
        if TARGET in sys.modules and getattr(sys.modules[TARGET], "distributed", None) is not None:
            register()
        return  # torch is being imported right now: nothing safe to do but wait for a later call
    after_import(TARGET, register)
