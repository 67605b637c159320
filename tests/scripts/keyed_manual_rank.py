"""One rank of torch.distributed's manual template, its store keyed by TANDEM_STORE_KEY."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import tandem as td

rank = int(sys.argv[1])
td.init(rank=rank, world_size=2, timeout=60)
if rank == 0:  # rank 0 hosts the store: a client without the key gets nothing
    try:
        raw = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                            wait_for_workers=False, timeout=timedelta(seconds=3))
        print(f"raw client read {raw.num_keys()} keys")
    except Exception as error:
        print(f"raw client refused: {type(error).__name__}")
total = td.allreduce(torch.ones(1), op="sum").item()
print(f"rank {rank} total {total:g}")
td.shutdown()
