"""Ranks caught in their imports (`importing_gate`). With the argument `rank0-ready`, rank 0
skips them: it joins the job's store as td.init() does, says `ready` and waits, so a Ctrl-C
finds it past its start while rank 1 is still importing."""

import os
import sys
import threading

if not (sys.argv[1:] == ["rank0-ready"] and os.environ["TANDEM_RANK"] == "0"):
    import importing_gate  # noqa: F401  (waits inside the import)

from tandem.rendezvous import connect_store

store = connect_store(os.environ["TANDEM_MASTER_ADDR"], int(os.environ["TANDEM_MASTER_PORT"]),
                      key=os.environ["TANDEM_STORE_KEY"])
print("ready", flush=True)
threading.Event().wait(60)  # only the launcher ends this rank
