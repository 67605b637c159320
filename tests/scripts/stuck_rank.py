"""A fixed job in which rank 2 stops answering at step 3 (SIGSTOP: a hung rank)."""

import os
import signal

import torch

import tandem as td

td.init()
for step in range(10):
    if step == 3 and td.rank() == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    td.allreduce(torch.ones(2))
print("done")
