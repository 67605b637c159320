"""Rank 1 leaves while rank 0 waits for it in an all-reduce (`sys.argv[1]`: how it leaves).

  died   rank 1 ends its process abruptly (os._exit), as a crash would
  left   rank 1 calls td.shutdown() and exits 0, as a script that skipped the collective would

Rank 0's all-reduce fails ("Connection closed by peer" from Gloo) and must say which peer.
"""

import os
import sys

import torch

import tandem as td

td.init()
td.barrier()
if td.rank() == 1:
    if sys.argv[1] == "died":
        os._exit(0)
    td.shutdown()
    sys.exit(0)
td.allreduce(torch.ones(2))
print("not reached")
