"""A rank that joined torch.distributed but whose framework ran it as a copy says so.

Accelerate makes the process group from torchrun's variables and then, on a machine without
GPUs and without `Accelerator(cpu=True)`, runs every rank as one process of its own
(`DistributedType.NO`): each trains alone, though the group exists. At the rank's exit (the
framework's state is final by then) such a rank sets `tandem/copies/<rank>` on its launcher's
store, naming the framework; `tandem run` reads it once every rank is gone
(`launch/local/joined.py`). Nothing runs on the training path: one look at `sys.modules` at exit.
"""

from __future__ import annotations

import atexit
import sys

from tandem.rendezvous.client import StoreClient

REPORT_TIMEOUT_S = 5.0
KEY = "tandem/copies/"


def fell_back() -> str | None:
    """The framework that ran this process as a copy of its own (None: none did)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    kind = shared.get("distributed_type")
    if kind is not None and getattr(kind, "name", str(kind)) == "NO":
        return "accelerate"
    return None


def report_at_exit(host: str, port: int, key: str, rank: int) -> None:
    """At this process's exit, tell the launcher's store which framework ran it as a copy."""
    def report() -> None:
        framework = fell_back()
        if framework is None:
            return
        try:
            client = StoreClient(host, port, key, REPORT_TIMEOUT_S)
        except (ConnectionError, OSError, TimeoutError):
            return  # the launcher is gone: nothing to tell
        try:
            client.set(f"{KEY}{rank}", framework)
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            client.close()

    atexit.register(report)
