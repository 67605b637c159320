"""Prints what `tandem run` gave this rank, then checks the job with one real all-reduce (and
says which backend `td.init()` chose for it)."""

import os
import sys

import torch

import tandem as td

env = os.environ
print(
    f"rank={env['TANDEM_RANK']} size={env['TANDEM_SIZE']} local_rank={env['TANDEM_LOCAL_RANK']} "
    f"local_size={env['TANDEM_LOCAL_SIZE']} port={env['TANDEM_MASTER_PORT']} "
    f"hosted={env['TANDEM_STORE_HOSTED']} omp={env.get('OMP_NUM_THREADS')} "
    f"mkl={env.get('MKL_NUM_THREADS')} unbuffered={env.get('PYTHONUNBUFFERED')} "
    f"pid={os.getpid()} args={' '.join(sys.argv[1:])}"
)
print(f"stderr line from rank {env['TANDEM_RANK']}", file=sys.stderr)

world = td.init()
total = td.allreduce(torch.tensor([td.rank() + 1.0]), op="sum")
print(f"allreduce={total.item():g} backend={world.backend}")
td.shutdown()
