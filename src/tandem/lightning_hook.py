"""`Trainer(strategy="tandem")` after `import tandem`, without `import tandem` importing Lightning.

Lightning finds strategies in a registry, not through entry points, so someone must put
"tandem" there before `Trainer(strategy="tandem")` or `Fabric(strategy="tandem")` looks it up.
`import tandem` calls `install()`: with `lightning` already imported it registers now (by
importing `tandem.lightning`); otherwise one finder waits in `sys.meta_path` for `import
lightning`, lets Python run the package as usual (it loads `lightning.fabric` and
`lightning.pytorch` itself), registers right after, and takes itself out. The same trick as
`comm/torch_hook.py` for torch.distributed's backends. Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

TARGET = "lightning"


def register() -> None:
    """Import tandem.lightning, which registers "tandem" with the Trainer and with Fabric."""
    try:
        importlib.import_module("tandem.lightning")
    except Exception as error:  # noqa: BLE001 - importing lightning must never fail because of us
        warnings.warn(f"tandem could not register its Lightning strategy 'tandem': {error!r}",
                      stacklevel=2)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of `lightning` to register after it ran."""

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

        spec.loader.exec_module = exec_module  # this loader serves lightning's package alone
        return spec


def _remove(finder: _AfterLightning) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install() -> None:
    """Register the strategy with Lightning now, or as soon as `lightning` is imported."""
    if TARGET in sys.modules:
        if hasattr(sys.modules[TARGET], "Trainer"):  # fully imported, not half-way through
            register()
        return
    if not any(isinstance(finder, _AfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())
