"""An elastic job with sharded state and a peer backup, whose ranks are SIGKILLed at chosen
points of a step; the one-process run is the same script.

    tandem run -np 3 --min-np 2 --max-np 3 elastic_kill_points.py OUT --zero --kill 1:5:step
    python elastic_kill_points.py OUT                          # the one-process reference

Each step trains on a global batch of 12 rows made from the step alone; each rank takes its
equal share (`td.elastic.local_rows`). The state is `td.elastic.State(model, optimizer,
peer_backup=True)` over `td.ZeroOptimizer(Adam)` (--zero) or a `td.fully_shard` model (two
units) with Adam over its shards (--fsdp). Rank 0 writes the final parameters, the world size
of each step and the step to OUT.

--kill W:S:POINT[,W:S:POINT...]: worker W sends itself SIGKILL at step S (`state.step` when
the step began), at POINT:
  forward   inside the forward, between the two layers (fully_shard: between its gathers)
  backward  inside the backward, when the output's gradient arrives (before any reduction)
  step      inside optimizer.step, after the gradients were reduced (the torch optimizer's
            pre-step hook: ZeroOptimizer's reduce-scatter is done, no parameter updated yet)
  commit    inside state.commit, after the peer-backup exchange, before the commit's
            agreement (the others hold this commit; it never counted)
  between   after the commit of step S-1, before step S begins
"""

import argparse
import os
import signal

import torch

import tandem as td

GLOBAL_BATCH = 12

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--kill", default="")
parser.add_argument("--zero", action="store_true")
parser.add_argument("--fsdp", action="store_true")
args = parser.parse_args()

td.init()
worker = int(os.environ.get("TANDEM_ELASTIC_WORKER", "0"))
kills = {}  # (worker, step) -> point
for item in filter(None, args.kill.split(",")):
    w, s, point = item.split(":")
    assert point in ("forward", "backward", "step", "commit", "between"), point
    kills[(int(w), int(s))] = point
torch.manual_seed(worker)  # every worker starts from another model: the state sync fixes it
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
if args.fsdp:  # two units: the first layer, and the root (the rest)
    td.fully_shard(model[0])
    td.fully_shard(model)
inner = torch.optim.Adam(model.parameters(), lr=0.01)
optimizer = td.ZeroOptimizer(inner) if args.zero else inner
now = {"step": -1}  # the step under way, for the hooks


def die_at(point: str) -> None:
    if kills.get((worker, now["step"])) == point:
        os.kill(os.getpid(), signal.SIGKILL)


model[2].register_forward_pre_hook(lambda module, inputs: die_at("forward"))
inner.register_step_pre_hook(lambda opt, a, k: die_at("step"))


class KilledState(td.elastic.State):
    """`td.elastic.State` whose commit can be cut short after its peer-backup exchange."""

    def check_host_updates(self) -> None:
        die_at("commit")
        super().check_host_updates()


state = KilledState(model=model, optimizer=optimizer, step=0, sizes=[], peer_backup=True)


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), \
        torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


@td.elastic.run
def train(state):
    while state.step < args.steps:
        now["step"] = state.step
        die_at("between")
        x, y = batch(state.step)
        rows = td.elastic.local_rows(GLOBAL_BATCH)
        optimizer.zero_grad()
        out = model(x[rows])
        out.register_hook(lambda grad: die_at("backward"))
        torch.nn.functional.cross_entropy(out, y[rows]).backward()
        optimizer.step()
        state.sizes = state.sizes + [td.size()]
        state.step += 1
        state.commit()
    now["step"] = -1


train(state)
params = {k: v.clone() for k, v in model.state_dict().items()}  # collective when sharded
if td.rank() == 0:
    torch.save({"params": params, "sizes": state.sizes, "step": state.step}, args.out)
td.shutdown()
