"""Rank 1 never creates the group that rank 0 creates: it blocks outside any collective.

Rank 0 waits in the group's agreement (a watched all-reduce on the world), so the watchdog
names rank 1 at the timeout, with its stack, and the job ends instead of hanging inside the
engine's own group set-up. `sys.argv[1]`: "new_group" or "mesh", what rank 0 calls.
"""

import sys
import threading

import tandem as td

td.init()
td.barrier()
if td.rank() == 1:
    threading.Event().wait()  # never set: rank 1 is busy elsewhere, for ever
if sys.argv[1] == "mesh":
    td.mesh(dp=td.size())
else:
    td.new_group(list(range(td.size())))
print("not reached")
