"""A preemptible training script with a step time of its own, for jobs that are signalled from
outside: a SLURM batch job (tests/test_preemption_slurm.py) and the stress run
(benchmarks/preemption_stress.py, tests/test_preemption_stress.py).

    python preemptible_steps.py DIR OUT [--step-s S] [--epochs E] [--every K]

Trains from the newest checkpoint in DIR (a td.Checkpointer saving every K steps, keeping 2) and
writes the final parameters to OUT (rank 0). Each step sleeps S seconds, the compute a real step
would take, so that a signal sent while the job runs lands mid-training. Rank 0 prints
`start <step>` once restored, `step N` after each step and `saving N` before each save it
makes, so a driver can aim a signal at a step, at a save or at the start-up. The same script,
run alone (`python preemptible_steps.py ...`), is the one-process reference.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import tandem as td

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("out")
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--every", type=int, default=1000)
args = parser.parse_args()

td.init()
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=generator),
                                      torch.randint(0, 3, (96,), generator=generator))
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
loader, _ = td.partition_dataset(data, batch_size=12, seed=0, pad=False)
checkpointer = td.Checkpointer(args.directory, every=args.every, keep=2)
step = checkpointer.restore(model=model, optimizer=opt, data=loader)
if td.rank() == 0:
    print(f"start {step}", flush=True)
while loader.epoch < args.epochs:
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(args.step_s)
        if td.rank() == 0 and (step + 1) % args.every == 0:
            print(f"saving {step + 1}", flush=True)
        checkpointer.save(step, model=model, optimizer=opt, data=loader)  # exits 75 if preempted
        step += 1
        if td.rank() == 0:
            print(f"step {step}", flush=True)
if td.rank() == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
td.shutdown()
