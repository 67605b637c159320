"""One of two jobs that must run at the same time: rank 0s meet on the test's own store."""

import os
import sys
from datetime import timedelta

import torch

import tandem as td
from tandem.rendezvous import connect_store

td.init()
if td.rank() == 0:
    # A barrier across the two jobs: whoever arrives second opens the gate for both.
    meeting = connect_store("127.0.0.1", int(sys.argv[1]))
    if meeting.add("arrived", 1) == 2:
        meeting.set("go", "1")
    meeting.wait(["go"], timedelta(seconds=120))
td.barrier()
total = td.allreduce(torch.ones(1), op="sum")
print(f"port={os.environ['TANDEM_MASTER_PORT']} allreduce={total.item():g}")
td.shutdown()
