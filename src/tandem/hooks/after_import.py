"""Run a function right after a package is first imported, without importing it ourselves.

`import tandem` must not import torch or Lightning (the `tandem` command starts without them),
yet a script that imports tandem first expects `dist.init_process_group("tandem")` and
`Trainer(strategy="tandem")` to work once it imports them. `after_import(name, callback)` puts
one finder in front of `sys.meta_path`: it finds nothing itself, but when `import name` comes,
it asks the real finders, lets Python run the package's module as usual, calls `callback`
right after, and takes itself out. Standard library only (the lowest layer, beside settings).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the real loader of one package so that `callback` runs after its module did."""

    def __init__(self, target: str, callback: Callable[[], None]) -> None:
        self.target, self.callback = target, callback
        self._looking = False

    def find_spec(self, name, path, target=None):
        if name != self.target or self._looking:
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
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            self.callback()

        spec.loader.exec_module = exec_module  # this loader serves that package alone
        return spec


def after_import(target: str, callback: Callable[[], None]) -> None:
    """Call `callback` once `import target` has run (once, however often this is called)."""
    if not any(isinstance(f, _AfterImport) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(target, callback))
