"""A preemptible training script, as a user writes it: a Checkpointer that also keeps the loader's
place, so a job stopped by a preemption signal resumes at the exact sample.

    tandem run -np 2 preemptible_train.py DIR OUT     # SIGUSR1 to tandem run: exit 75, saved
    tandem run -np 3 preemptible_train.py DIR OUT     # resumes, writes the parameters to OUT
    python preemptible_train.py DIR OUT               # one process, uninterrupted

Each step sleeps 50 ms: the compute a real step would take, so that a signal sent while the job
runs lands mid-training. Rank 0 prints `step N` after each step.
"""

import sys
import time

import torch
import torch.nn.functional as F

import tandem as td

directory, out = sys.argv[1], sys.argv[2]
td.init()
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=generator),
                                      torch.randint(0, 3, (96,), generator=generator))
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
loader, _ = td.partition_dataset(data, batch_size=12, seed=0, pad=False)
checkpointer = td.Checkpointer(directory, every=1000, keep=1)
step = checkpointer.restore(model=model, optimizer=opt, data=loader)
while loader.epoch < 4:
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
        checkpointer.save(step, model=model, optimizer=opt, data=loader)  # exits 75 if preempted
        step += 1
        if td.rank() == 0:
            print(f"step {step}", flush=True)
state = {k: v.clone() for k, v in model.state_dict().items()}
if td.rank() == 0:
    torch.save(state, out)
td.shutdown()
