"""Two pipeline stages out of step at step 2, as `sys.argv[1]` says:

  collective  rank 1 (the last stage) logs with td.allreduce while stage 0 trains
  eval        rank 1 evaluates (`pipe(x)`) while stage 0 trains

    tandem run -np 2 pipeline_out_of_step.py collective|eval
"""

import sys

import torch
from torch import nn

import tandem as td

td.init()
torch.manual_seed(0)
pipe = td.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), chunks=2)
opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
mode = sys.argv[1]
for step in range(5):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    if step == 2 and td.rank() == 1:
        if mode == "collective":
            td.allreduce(torch.ones(1))
        else:
            pipe(x)
        continue
    pipe.train_step(x, y, nn.functional.mse_loss)
    opt.step()
    opt.zero_grad()
print("finished", flush=True)
