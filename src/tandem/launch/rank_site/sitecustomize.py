"""Start-up of a rank of `tandem run`: import tandem, then the `sitecustomize` we stand before.

`import tandem` imports no torch; it registers with torch.distributed when the script imports
it (`comm.torch_hook`). A Python without tandem (`tandem run -np 2 /other/python x.py`) starts as
it would have. Whatever `sitecustomize` comes later on sys.path (a distribution's, a user's)
still runs, as if this one were not there.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # the next one is `sitecustomize` from now on
    spec.loader.exec_module(module)


try:
    # By name: this file runs as the rank's top-level `sitecustomize`, not as a part of the
    # launcher (whose layer must not reach tandem's front door and its torch hooks).
    importlib.import_module("tandem")  # its import hook is what the rank needs
except ImportError:
    pass
_chain()
