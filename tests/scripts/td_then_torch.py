"""tandem first, torch.distributed second: after `td.init()` torch's libraries find the job
(on MPI too): DistributedSampler, dist.get_rank(), and destroy_process_group() in the script.
On Gloo and NCCL torch's group is tandem's engine itself: tandem's collectives end with it."""

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import tandem as td

world = td.init()
assert dist.is_initialized() and dist.get_rank() == world.rank
assert dist.get_world_size() == world.size
sampler = DistributedSampler(list(range(10)), shuffle=False)
mine = list(iter(sampler))
assert mine == list(range(world.rank, 10, world.size)), mine
dist.init_process_group("tandem")  # after td.init, the same backend: nothing to do
try:
    dist.init_process_group("gloo" if world.backend != "gloo" else "nccl")
except ValueError as error:
    print(f"refused: {error}")
t = torch.tensor([1.0])
dist.all_reduce(t)
dist.destroy_process_group()  # the script's call, as in torch's tutorials
if world.backend == "mpi":  # tandem's engine is not torch's group there: it still runs
    assert td.allreduce(torch.ones(1), op="sum").item() == world.size
print(f"sampler={mine} torch_sum={t.item():g} backend={world.backend}")
td.shutdown()
