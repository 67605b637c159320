"""A small data-parallel training job that fails on purpose, as `sys.argv[1]` says.

    tandem run -np 2 [--max-restarts 1] fault_train.py MODE --steps 20 --at 7 --rank 1 \
        [--ckpt DIR] [--every 3] [--out params.pt] [--shard]

`--shard`: the model is fully sharded (td.fully_shard per layer and the root, plain SGD), so
the checkpoints are sharded directories.

Every step draws its data from (seed, step, rank), so a job restarted from a checkpoint ends
with the same parameters as one that never stopped. Modes (the fault happens at step --at on
rank --rank, on the first attempt only, TANDEM_RESTART=0):

  ok         no fault
  kill       SIGKILL
  raise      an exception
  hang       block outside any collective (on an Event that is never set)
  skip       skip the step's loss all-reduce and go on to a barrier
  skip_recv  skip the loss all-reduce and wait for a message from rank 0 that never comes
  skip_step  skip the whole step on one rank (`if not torch.isfinite(loss): continue` there only)
  skip_opt   run backward but skip the optimizer step on one rank
  diverge    call td.broadcast where the others step the optimizer
  save_kill  rank 0 is SIGKILLed inside td.save, after the write and before the rename

Each rank prints its pid first (for the orphan checks), rank 0 prints each step's loss and, at
the end, a checksum of the parameters (and writes them to --out).
"""

import argparse
import os
import signal
import threading
import time

import torch
from torch import nn

import tandem as td
import tandem.checkpoint.dcp_files as dcp_files

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--at", type=int, default=7)
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--ckpt")
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--out")
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--shard", action="store_true")
args = parser.parse_args()

td.init()
me = td.rank()
first_attempt = os.environ.get("TANDEM_RESTART", "0") == "0"
print(f"pid={os.getpid()} attempt={os.environ.get('TANDEM_RESTART', '0')}", flush=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
if args.shard:
    for module in (model[0], model[2], model):
        td.fully_shard(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
else:
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters())
ckpt = td.Checkpointer(args.ckpt, every=args.every) if args.ckpt else None
start = ckpt.restore(model=model, optimizer=opt) if ckpt else 0
if start and me == 0:
    print(f"resumed at step {start}")


def fault(step: int) -> bool:
    faults = ("kill", "raise", "hang", "skip", "skip_recv", "skip_step", "skip_opt", "diverge")
    return first_attempt and step == args.at and me == args.rank and args.mode in faults


for step in range(start, args.steps):
    generator = torch.Generator().manual_seed(1000 * step + me)
    x = torch.randn(32, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = nn.functional.mse_loss(model(x), y)
    if fault(step) and args.mode in ("skip_step", "diverge"):
        print(f"failing at {time.time()}", flush=True)
        if args.mode == "diverge":
            td.broadcast(torch.zeros(3))  # the others are in the gradient reduction
        continue  # the wrong way to skip a step: this rank alone
    opt.zero_grad()
    loss.backward()
    if fault(step) and args.mode == "skip_opt":
        print(f"failing at {time.time()}", flush=True)
    else:
        opt.step()
    if fault(step) and args.mode != "skip_opt":
        if args.mode == "kill":
            print(f"failing at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "raise":
            print(f"failing at {time.time()}", flush=True)
            raise RuntimeError(f"rank {me} fails on purpose at step {step}")
        if args.mode == "hang":
            print(f"failing at {time.time()}", flush=True)
            threading.Event().wait()  # never set: only the watchdog or the launcher ends this
        if args.mode == "skip":
            print(f"failing at {time.time()}", flush=True)
            td.barrier()  # the others are in the loss all-reduce below
        if args.mode == "skip_recv":
            print(f"failing at {time.time()}", flush=True)
            td.recv(torch.zeros(1), src=0)  # rank 0 never sends: each waits for the other
    else:
        mean_loss = td.allreduce(loss.detach(), op="mean")
        if me == 0:
            print(f"step {step} loss {mean_loss.item():.6f}", flush=True)
    if ckpt:
        if args.mode == "save_kill" and first_attempt and me == 0 and step >= args.at:
            # The next save dies between the write of the new checkpoint and its rename.
            def die(path):
                print(f"failing at {time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            dcp_files._before_publish = die
        ckpt.save(step, model=model, optimizer=opt)
    if args.step_seconds:
        time.sleep(args.step_seconds)

parameters = td.fsdp.full_state_dict(model).values() if args.shard else model.parameters()
flat = torch.cat([p.detach().flatten() for p in parameters])
if me == 0:
    print(f"final {flat.double().sum().item():.12f}", flush=True)
    if args.out:
        torch.save(flat, args.out)
td.shutdown()
