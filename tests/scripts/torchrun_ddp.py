"""A plain torchrun DDP script (no tandem in it): `torchrun --nproc-per-node 2 torchrun_ddp.py
BACKEND OUT` and `tandem run -np 2 torchrun_ddp.py BACKEND OUT` must train the same model.

Each rank trains on its half of a fixed batch for 5 steps; rank 0 saves the parameters to OUT.
BACKEND is what init_process_group gets ("gloo", or "tandem"/"mpi", which `import tandem`
registers: then the script imports tandem, and only for that).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

backend, out = sys.argv[1], sys.argv[2]
if backend in ("tandem", "mpi"):
    import tandem  # noqa: F401  (registers the backends)

dist.init_process_group(backend)
rank, size = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and size == int(os.environ["WORLD_SIZE"])
assert dist.is_torchelastic_launched()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ddp = DDP(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
shard = slice(rank * 16 // size, (rank + 1) * 16 // size)
for _ in range(5):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
    optimizer.step()
if rank == 0:
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, out)
print(f"rank {rank} of {size} on {dist.get_backend()} done")
dist.destroy_process_group()
