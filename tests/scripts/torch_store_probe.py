"""Under `tandem run`: a torch.distributed script (tandem is imported only for its backends).

argv: BACKEND [ADDRESS]. Every rank joins with `dist.init_process_group(BACKEND)` (env://, the
torchrun variables, or a MASTER_PORT the script sets itself when HARD_PORT is in the
environment, as tutorials do) and all-reduces its rank + 1. Rank 0 then tries to reach the
store's port at ADDRESS, an address of this machine that is not loopback, and prints one line:
`PROBE <sum> <port> <reached>`.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

backend = sys.argv[1]
if backend != "gloo":
    import tandem  # noqa: F401 - registers "tandem", and "mpi" where torch has none

if "HARD_PORT" in os.environ:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["HARD_PORT"]
dist.init_process_group(backend)
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
if dist.get_rank() == 0:
    port = int(os.environ["MASTER_PORT"])
    reached = None
    if len(sys.argv) > 2:
        with socket.socket() as probe:
            probe.settimeout(10)
            reached = probe.connect_ex((sys.argv[2], port)) == 0
    print(f"PROBE {total.item():g} {port} {reached}", flush=True)
dist.barrier()  # the store lives until rank 0 probed it
dist.destroy_process_group()
