"""An elastic job whose data position is part of its state, as a user writes it.

    tandem run -np 3 --min-np 2 --max-np 3 elastic_loader.py OUT --die 2:3
    python elastic_loader.py OUT                      # the one-process reference

The `td.partition_dataset` loader is kept in the `td.elastic.State` as an extra: each commit
keeps its position (epoch, place in the epoch's order), and after a change of world the rest of
the epoch is split over the ranks that are left. Every step gathers the ids of the samples the
ranks read into the state (`seen`, rolled back with it), so rank 0 writes the one list of
global batches the job trained on, the world size of each step and the final parameters to OUT.

  --die W:S   worker W exits with code 9 in the middle of step S (after its forward)
"""

import argparse
import os

import torch
import torch.nn.functional as F

import tandem as td

N, BATCH, EPOCHS, SEED = 60, 12, 2, 3  # 5 steps an epoch; 12 splits over 1, 2 and 3 ranks

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--die", default=None)
args = parser.parse_args()
die = tuple(map(int, args.die.split(":"))) if args.die else None

td.init()
worker = int(os.environ.get("TANDEM_ELASTIC_WORKER", "0"))
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(N, 6, generator=generator),
                                      torch.randint(0, 3, (N,), generator=generator),
                                      torch.arange(N))
torch.manual_seed(worker)  # every worker starts from another model: the state sync fixes it
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
loader, _ = td.partition_dataset(data, batch_size=BATCH, seed=SEED, pad=False)
state = td.elastic.State(model=model, optimizer=opt, loader=loader, step=0, seen=[], sizes=[])


@td.elastic.run
def train(state):
    while state.loader.epoch < EPOCHS:
        for x, y, ids in state.loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if die is not None and (worker, state.step) == die:
                os._exit(9)
            loss.backward()
            opt.step()
            batch = sorted(i for part in td.allgather_object(ids.tolist()) for i in part)
            state.seen = state.seen + [batch]
            state.sizes = state.sizes + [td.size()]
            state.step += 1
            state.commit()


train(state)
if td.rank() == 0:
    torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
                "seen": state.seen, "sizes": state.sizes, "step": state.step}, args.out)
td.shutdown()
