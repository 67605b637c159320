"""Rank 0 (and its child) wait for ever; rank 1 fails as `sys.argv[1]` says.

Modes: raise (an exception), sigkill (kills itself), exit3 (exits with code 3), stubborn (raise,
while rank 0 ignores SIGTERM so only SIGKILL stops it), wait (every rank waits, for tests that
signal the agent). Each rank prints its pid, and rank 0 the pid of
a child it started, so the test can check that nothing outlives the job. Ranks meet on the
launcher's store before rank 1 fails, so every pid is printed by then.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from tandem.rendezvous import connect_store

mode = sys.argv[1]
rank = int(os.environ["TANDEM_RANK"])
if mode == "stubborn" and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
store = connect_store(os.environ["TANDEM_MASTER_ADDR"], int(os.environ["TANDEM_MASTER_PORT"]),
                      key=os.environ["TANDEM_STORE_KEY"])
print(f"pid={os.getpid()}")
if rank == 0:
    child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait(600)"])
    print(f"pid={child.pid}")
store.set(f"ready{rank}", "1")
store.wait([f"ready{peer}" for peer in range(int(os.environ["TANDEM_SIZE"]))], timedelta(seconds=120))
print("ready")

if rank == 1 and mode != "wait":
    print(f"failing at {time.time()}")
    if mode in ("raise", "stubborn"):
        raise RuntimeError("rank 1 exploded on purpose")
    if mode == "sigkill":
        os.kill(os.getpid(), 9)
    if mode == "exit3":
        sys.exit(3)
threading.Event().wait(600)  # never set: only the launcher ends this rank
