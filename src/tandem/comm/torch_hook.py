"""tandem's torch.distributed backends, registered once torch is there, without importing it.

`import tandem` must not import torch (the `tandem` command starts without it), yet a script
that imports tandem before torch expects `dist.init_process_group("tandem")` (and "mpi") to
work. So `import tandem` calls `install()`: with torch already imported it registers the
backends now (`torch_register.register`); otherwise it puts one finder in front of
`sys.meta_path` that waits for `import torch`, lets Python load torch as usual, registers right
after torch's module has run (torch imports torch.distributed itself), and takes itself out.
That finder is the one thing `import tandem` does besides defining names: STYLE.md's
"no import-time side effects", with the exception issue 27 asks for. Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

TARGET = "torch"


def register() -> None:
    """Register now; a torch without torch.distributed (or another than expected) is a warning."""
    try:
        import torch.distributed

        if not torch.distributed.is_available():
            return  # a torch built without distributed support: nothing to register with
        from tandem.comm.torch_register import register as add_backends

        add_backends()
    except Exception as error:  # noqa: BLE001 - importing torch must never fail because of us
        warnings.warn(f"tandem could not register its torch.distributed backends: {error!r}",
                      stacklevel=2)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of `torch` to register after it ran."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name, path, target=None):
        if name != TARGET or self._looking:
            return None
        self._looking = True  # the real finders answer the question below
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _remove(self)
            register()

        spec.loader.exec_module = exec_module  # this loader serves torch's package alone
        return spec


def _remove(finder: _AfterTorch) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install() -> None:
    """Register tandem's backends with torch.distributed now, or as soon as torch is imported."""
    if "torch.distributed" in sys.modules or TARGET in sys.modules:
        if TARGET in sys.modules and getattr(sys.modules[TARGET], "distributed", None) is not None:
            register()
        return  # torch is being imported right now: nothing safe to do but wait for a later call
    if not any(isinstance(finder, _AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
