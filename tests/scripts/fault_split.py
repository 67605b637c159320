"""A small split-model training job whose rank --rank takes another path at step --at.

    tandem run -np 2 fault_split.py MODE --layout shard|tp|pipe --steps 30 --at 7 --rank 1

Layouts: `shard` (td.fully_shard per layer, then the root), `tp` (td.parallelize, colwise then
rowwise, every rank on the same batch), `pipe` (td.Pipeline, one stage per rank). Modes:

  ok          no fault
  skip_step   skip the step after the forward (`if torch.isnan(loss): continue` on this rank
              only); on a pipeline, skip the whole iteration (train_step and optimizer step)
  skip_opt    run the step but skip the optimizer step (on a pipeline: the last stage's NaN
              guard, the only stage that has the loss)
  state_dict  call td.full_state_dict alone (the habitual "save on rank 0")

Each rank prints its pid first (for the orphan checks) and `failing at T` (wall time) when it
takes the other path; rank 0 prints `finished` at the end.
"""

import argparse
import os
import time

import torch
from torch import nn

import tandem as td

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("--layout", choices=("shard", "tp", "pipe"), default="shard")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--at", type=int, default=7)
parser.add_argument("--rank", type=int, default=1)
args = parser.parse_args()

td.init()
me, size = td.rank(), td.size()
print(f"pid={os.getpid()} layout={args.layout}", flush=True)
torch.manual_seed(0)
if args.layout == "pipe":
    layers = [m for _ in range(size) for m in (nn.Linear(8, 8), nn.Tanh())]
    model = td.Pipeline(nn.Sequential(*layers, nn.Linear(8, 1)), chunks=2)
else:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if args.layout == "shard":
        for module in (model[0], model[2], model):
            td.fully_shard(module)
    else:
        td.parallelize(model, {"0": "colwise", "2": "rowwise"})
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def fault(step: int, mode: str) -> bool:
    if step == args.at and me == args.rank and args.mode == mode:
        print(f"failing at {time.time()}", flush=True)
        return True
    return False


for step in range(args.steps):
    # Fully sharded: each rank its own data; tensor parallel and pipeline: the same batch.
    generator = torch.Generator().manual_seed(1000 * step + (me if args.layout == "shard" else 0))
    x = torch.randn(32, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    if args.layout == "pipe":
        if fault(step, "skip_step"):
            continue
        model.train_step(x, y, nn.functional.mse_loss)
    else:
        loss = nn.functional.mse_loss(model(x), y)
        if fault(step, "skip_step"):
            continue
        opt.zero_grad()
        loss.backward()
    if not fault(step, "skip_opt"):
        opt.step()
    if args.layout == "pipe":
        opt.zero_grad()
    if fault(step, "state_dict"):
        td.fsdp.full_state_dict(model)  # the others go on training
if me == 0:
    print("finished", flush=True)
td.shutdown()
