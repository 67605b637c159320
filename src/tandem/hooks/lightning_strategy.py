"""`Trainer(strategy="tandem")` after `import tandem`, without `import tandem` importing Lightning.

Lightning finds strategies in a registry, not through entry points, so someone must put
"tandem" there before `Trainer(strategy="tandem")` or `Fabric(strategy="tandem")` looks it up.
`import tandem` calls `install()`: with `lightning` already imported it registers now (by
importing `tandem.lightning`); otherwise `import_hooks.after_import` registers right after
`import lightning` has run (it loads `lightning.fabric` and `lightning.pytorch` itself), as
`hooks/torch_backends.py` does for torch.distributed's backends. Standard library only.
"""

from __future__ import annotations

import importlib
import sys
import warnings

from tandem.hooks.after_import import after_import

TARGET = "lightning"


def register() -> None:
    """Import tandem.lightning, which registers "tandem" with the Trainer and with Fabric."""
    try:
        importlib.import_module("tandem.lightning")
    except Exception as error:  # noqa: BLE001 - importing lightning must never fail because of us
        warnings.warn(f"tandem could not register its Lightning strategy 'tandem': {error!r}",
                      stacklevel=2)


def install() -> None:
    """Register the strategy with Lightning now, or as soon as `lightning` is imported."""
    if TARGET in sys.modules:
        if hasattr(sys.modules[TARGET], "Trainer"):  # fully imported, not half-way through
            register()
        return
    after_import(TARGET, register)
