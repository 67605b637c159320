"""Data × pipeline parallelism: two replicas of a two-stage pipeline on four ranks.

    tandem run -np 4 examples/hybrid_2x2.py

`td.mesh(dp=2, pp=2)` lays the ranks out as 2 replicas × 2 stages (global rank =
dp_rank * 2 + pp_rank): ranks 0-1 form one pipeline, ranks 2-3 the other. Each pipeline trains
on its half of every global batch; after the backward pass each stage averages its gradients
with the same stage of the other replica (the dp group), so both replicas take the same step
a single process would take on the whole batch.
"""

import torch
from torch import nn

import tandem as td

td.init()
mesh = td.mesh(dp=2, pp=2)

torch.manual_seed(0)
w = torch.randn(16, 1) / 4
x_all = torch.randn(2048, 16)
y_all = torch.tanh(x_all @ w) + 0.05 * torch.randn(2048, 1)

model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
pipe = td.Pipeline(model, chunks=4, group=mesh.pp_group)
optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
# Each stage's gradients are averaged over its dp group once per step: the pipeline holds the
# reduction back until the last of its 4 micro-batch backward passes.
optimizer = td.DistributedOptimizer(optimizer, named_parameters=pipe.named_parameters(),
                                    group=mesh.dp_group)

print(f"rank {td.rank()}: replica {mesh.dp_rank}, stage {mesh.pp_rank}, "
      f"keeps {[name for name, _ in pipe.named_parameters()]}")

global_batch = 128
half = global_batch // mesh.dp
for epoch in range(5):
    total, steps = 0.0, 0
    for start in range(0, len(x_all), global_batch):
        mine = slice(start + mesh.dp_rank * half, start + (mesh.dp_rank + 1) * half)
        optimizer.zero_grad()
        loss = pipe.train_step(x_all[mine], y_all[mine], nn.functional.mse_loss)
        if not hasattr(td, "DistributedOptimizer"):
            for param in pipe.parameters():
                td.allreduce(param.grad, op="mean", inplace=True, group=mesh.dp_group)
        optimizer.step()
        if pipe.is_last:
            total, steps = total + loss.item(), steps + 1
    if pipe.is_last:
        # The last stage of each replica saw its own half; average the two for the global loss.
        mean = td.allreduce(torch.tensor(total / steps), op="mean", group=mesh.dp_group)
        if mesh.dp_rank == 0:
            print(f"epoch {epoch}: loss {mean.item():.4f}")
