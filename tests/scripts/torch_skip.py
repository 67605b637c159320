"""A torch DDP script in which rank 1 skips one all_reduce of the loss it logs.

    torch_skip.py BACKEND mid|last [no-destroy]

`mid`: at step 2, and training goes on, so rank 0's all_reduce meets rank 1's next DDP
reduction. `last`: at the last step, and rank 1 then leaves the job while rank 0 waits.
`no-destroy`: the script ends without `destroy_process_group()`, as many do.

Under torch alone the job waits to its timeout (30 minutes); on backend "tandem" (argv[1]) it
ends within seconds, naming what diverged.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tandem  # noqa: F401  (registers the backend)

dist.init_process_group(sys.argv[1])
where = sys.argv[2]
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 6
skipped = 2 if where == "mid" else steps - 1
for step in range(steps):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    if not (rank == 1 and step == skipped):
        dist.all_reduce(logged)
    print(f"step {step} loss {logged.item():.4f}", flush=True)
if sys.argv[3:] != ["no-destroy"]:
    dist.destroy_process_group()
