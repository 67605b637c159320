"""A torch DDP script in which rank 1 skips one all_reduce (the loss it logs at step 2).

Under torch alone the job waits to its timeout (30 minutes); on backend "tandem" (argv[1]) the
watchdog ends it within seconds, naming both ranks.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tandem  # noqa: F401  (registers the backend)

dist.init_process_group(sys.argv[1])
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    if not (rank == 1 and step == 2):
        dist.all_reduce(logged)
    print(f"step {step} loss {logged.item():.4f}", flush=True)
dist.destroy_process_group()
