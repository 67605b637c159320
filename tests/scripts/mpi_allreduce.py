"""Started by `mpiexec -n 2`: td.init() must choose the MPI backend by itself."""

import torch

import tandem as td

world = td.init()
total = td.allreduce(torch.tensor([td.rank() + 1.0]), op="sum")
print(f"rank {world.rank} of {world.size}: backend={world.backend} sum={total.item():g}", flush=True)
td.shutdown()
