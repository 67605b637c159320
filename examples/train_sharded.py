"""Train a model whose parameters + gradients + Adam state do not fit in one rank's budget.

    tandem run -np 2 examples/train_sharded.py                  # 72 MiB per rank: fits
    python examples/train_sharded.py                            # one process: refuses, says why

The budget is `--limit-mb` (64 MiB) per rank for parameters, gradients and optimizer state.
The model (`--blocks` x Linear(1024, 1024) and a head, 7.3 M parameters) needs 16 bytes per parameter
with Adam in fp32 (weights, gradient, two moments): about 117 MB, over the budget on one
rank. `td.fully_shard` keeps 1/N of each on every rank, plus the blocks gathered around the
running layer (it, the prefetched next, the root's head): with 2 ranks about 56 + 12 MiB.
Each block is sharded as soon as it is built: the whole model never exists on one rank.
The task: regress a fixed random teacher network; the loss falls, and the budget is checked after every step.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import tandem as td

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--blocks", type=int, default=6)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--limit-mb", type=float, default=72.0, help="per-rank budget, MiB")
parser.add_argument("--checkpoint", default=None, help="a directory for sharded checkpoints")
args = parser.parse_args()

td.init()
limit = args.limit_mb * 2**20
full_need = 16 * (args.blocks + 1) * (args.width * args.width + args.width)
if td.rank() == 0:
    print(f"{td.size()} rank(s); full parameters + gradients + Adam state: {full_need / 2**20:.0f} MiB, "
          f"budget {args.limit_mb:.0f} MiB per rank")

# Build block by block, sharding each at once: no rank ever holds the whole model.
torch.manual_seed(0)
model = nn.Sequential()
for _ in range(args.blocks):
    model.append(td.fully_shard(nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())))
model.append(nn.Linear(args.width, args.width))  # the head: the root unit's own parameters
td.fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
checkpoints = td.Checkpointer(args.checkpoint, every=10) if args.checkpoint else None
start = checkpoints.restore(model=model, optimizer=optimizer) if checkpoints else 0

teacher = nn.Linear(args.width, args.width)  # the same on every rank (seeded above)
per_rank = 64 // td.size()


def held_bytes() -> int:
    """Parameters, gradients and optimizer state this rank holds, plus two gathered blocks
    (the running one and the prefetched next; the root's head stays gathered too)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) + 3 * 4 * (args.width * args.width + args.width)


for step in range(start, args.steps):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, args.width, generator=g)[td.rank() * per_rank : (td.rank() + 1) * per_rank]
    with torch.no_grad():
        y = torch.tanh(teacher(x))
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    td.clip_grad_norm_(model, 1.0)
    optimizer.step()
    if held_bytes() > limit:
        raise SystemExit(f"rank {td.rank()}: {held_bytes() / 2**20:.1f} MiB held, over the "
                         f"{args.limit_mb:.0f} MiB budget: run on more ranks (tandem run -np 2)")
    if checkpoints:
        checkpoints.save(step, model=model, optimizer=optimizer)
    if td.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
        mean = td.allreduce(loss.detach()).item()
        print(f"step {step:3d}  loss {mean:.5f}  held {held_bytes() / 2**20:.1f} MiB per rank")
    elif step % 10 == 0 or step == args.steps - 1:
        td.allreduce(loss.detach())
