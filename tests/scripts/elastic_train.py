"""An elastic training job, as a user writes it; the one-process run is the same script.

    tandem run -np 3 --min-np 2 --max-np 3 elastic_train.py OUT [options]
    python elastic_train.py OUT                              # the one-process reference

Each step trains on a global batch of 12 rows made from (seed, step) only; each rank takes its
equal share (`td.elastic.local_rows`), so every world size computes the same mean gradient.
Rank 0 writes the final parameters (and the world size of each step) to OUT.

Faults and events, by worker id (a worker keeps its id whatever its rank):
  --die W:S          worker W exits with code 9 in the middle of step S (after its forward)
  --stop W:S         worker W stops itself (SIGSTOP) in the middle of step S: a hung rank
  --die-before-commit W:S  worker W exits with code 9 after step S's update, before its
                     commit (the others commit without it: their backup exchange fails)
  --die-in-resize W  worker W exits with code 9 in its first reset callback (during a resize)
  --wait-size N:S    at step S, commit until the world has N ranks (a worker is joining);
                     several, comma-separated (2:5,3:8)
  --offer FILE       with --wait-size: rank 0 creates FILE at each such S first (the discovery
                     script offers more slots once it exists)
  --await-start S    at step S, once the world has shrunk, wait until a new worker's process
                     has started (OUT.started.W, made by every process at its start) before
                     training the step: the survivors then finish while it is still joining
  --grow-in-setup    before td.elastic.run, in a collective of the set-up (a td.broadcast from
                     rank 0), the first ranks wait until the launcher has formed the round that
                     adds a discovered worker (rank 0 waits for it on the store, then holds the
                     others in the broadcast for 2.5 s, past the watchdog's next look at its board)
  --optimizer adam   Adam instead of SGD with momentum (adafactor: Adafactor, which
                     td.ZeroOptimizer shards by whole parameters)
  --no-commit        never commit (the warning, and the start state as the fallback)
  --diverge W:S      worker W counts one step more than the others at step S (named at commit)
  --skip-commit W:S  worker W does not commit after step S (the others' commit is named)
  --horovod          the same job written against `tandem.horovod` (hvd.elastic)
  --ddp              the model wrapped in td.DistributedDataParallel, a plain torch optimizer
  --zero             td.ZeroOptimizer: the optimizer state sharded, resharded at each change
  --fsdp             td.fully_shard (two units), a plain torch optimizer over the shards
  --peer-backup      State(peer_backup=True): each rank keeps the previous rank's part too
  --checkpoint DIR   State(checkpointer=td.Checkpointer(DIR, every=4)): the disk fallback
  --scheduler        a StepLR kept in the State as an extra (restored in place, by value)
"""

import argparse
import os
import signal
import time

import torch

import tandem as td

GLOBAL_BATCH = 12

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--die", default=None)
parser.add_argument("--stop", default=None)
parser.add_argument("--die-before-commit", default=None)
parser.add_argument("--die-in-resize", type=int, default=None)
parser.add_argument("--wait-size", default=None)
parser.add_argument("--offer", default=None)
parser.add_argument("--await-start", default=None)
parser.add_argument("--grow-in-setup", action="store_true")
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--no-commit", action="store_true")
parser.add_argument("--diverge", default=None)
parser.add_argument("--skip-commit", default=None)
parser.add_argument("--horovod", action="store_true")
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--zero", action="store_true")
parser.add_argument("--fsdp", action="store_true")
parser.add_argument("--peer-backup", action="store_true")
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--scheduler", action="store_true")
args = parser.parse_args()
# for --await-start: this process has started (before td.init, where a newcomer waits to join)
open(f"{args.out}.started.{os.environ.get('TANDEM_ELASTIC_WORKER', '0')}", "w").close()

if args.horovod:
    import tandem.horovod as hvd

    hvd.init()
    elastic, make_state = hvd.elastic, hvd.elastic.TorchState
else:
    td.init()
    elastic, make_state = td.elastic, td.elastic.State
worker = int(os.environ.get("TANDEM_ELASTIC_WORKER", "0"))
torch.manual_seed(worker)  # every worker starts from another model: the state sync fixes it
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
if args.fsdp:  # two units: the first layer, and the root (the rest)
    td.fully_shard(model[0])
    td.fully_shard(model)
if args.optimizer == "adam":
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
elif args.optimizer == "adafactor":
    inner = torch.optim.Adafactor(model.parameters(), lr=0.01)
else:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if args.horovod:
    optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
elif args.ddp or args.fsdp:
    optimizer = inner
elif args.zero:
    optimizer = td.ZeroOptimizer(inner)
else:
    optimizer = td.DistributedOptimizer(inner)
net = td.DistributedDataParallel(model) if args.ddp else model
checkpointer = td.Checkpointer(args.checkpoint, every=4) if args.checkpoint else None
extras = {"peer_backup": True} if args.peer_backup else {}
if args.scheduler:  # steps the inner optimizer: its learning rate is what the wrapper uses
    extras["scheduler"] = torch.optim.lr_scheduler.StepLR(inner, step_size=5, gamma=0.5)
state = make_state(model=net, optimizer=optimizer, checkpointer=checkpointer, step=0, sizes=[],
                   **extras)



def grow_in_setup() -> None:
    """--grow-in-setup: the first ranks sit in a set-up collective while the job grows."""
    from tandem import runtime
    from tandem.rendezvous import StoreClient, elastic_rounds

    if runtime.joins_running_job():
        return  # the newcomer: its set-up collectives meet nobody
    probe = torch.zeros(1)
    if td.rank() == 0:
        job = runtime.state().job
        store = StoreClient(job.master_addr or "127.0.0.1", job.master_port, job.store_key, 60)
        joined = job.elastic.round
        deadline = time.monotonic() + 60
        while elastic_rounds.current_number(store) == joined:
            assert time.monotonic() < deadline, "the launcher never formed the grow round"
            try:
                store.wait([elastic_rounds.record_key(joined + 1)], timeout=1.0)
            except TimeoutError:
                pass
        store.close()
        # a duration, not an event: the others' wait outlives their watchdog's next tick (1 s)
        time.sleep(2.5)
        probe += 1
    td.broadcast(probe, root=0)
    assert probe.item() == 1


if args.grow_in_setup:
    grow_in_setup()

die = tuple(map(int, args.die.split(":"))) if args.die else None
die_before_commit = tuple(map(int, args.die_before_commit.split(":"))) \
    if args.die_before_commit else None
stop = tuple(map(int, args.stop.split(":"))) if args.stop else None
diverge = tuple(map(int, args.diverge.split(":"))) if args.diverge else None
skip = tuple(map(int, args.skip_commit.split(":"))) if args.skip_commit else None
waits = dict(tuple(map(int, w.split(":")))[::-1] for w in args.wait_size.split(",")) \
    if args.wait_size else {}  # step -> the world size to wait for there
await_start = int(args.await_start) if args.await_start else None
first_size = td.size()


def newcomer_started() -> bool:
    prefix = os.path.basename(args.out) + ".started."
    started = [name for name in os.listdir(os.path.dirname(os.path.abspath(args.out)))
               if name.startswith(prefix)]
    return any(int(name[len(prefix):]) >= first_size for name in started)


def die_in_resize():
    if worker == args.die_in_resize:
        os._exit(9)


state.register_reset_callbacks([die_in_resize])


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
    return x, y


@elastic.run
def train(state):
    while state.step < args.steps:
        if state.step in waits:
            wait = (waits[state.step], state.step)
            if args.offer and td.rank() == 0:
                open(args.offer, "w").close()
            deadline = time.monotonic() + 60
            while td.size() != wait[0]:  # a commit sees the new round and moves the job to it
                assert time.monotonic() < deadline, f"the world never grew to {wait[0]}"
                state.commit()
        if state.step == await_start and td.size() < first_size:
            deadline = time.monotonic() + 60
            while not newcomer_started():
                assert time.monotonic() < deadline, "no new worker started"
                time.sleep(0.05)  # polls for a file another process makes: no event to wait on
        x, y = batch(state.step)
        rows = td.elastic.local_rows(GLOBAL_BATCH)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
        if die is not None and (worker, state.step) == die:
            os._exit(9)
        if stop is not None and (worker, state.step) == stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        loss.backward()
        optimizer.step()
        if args.scheduler:
            state.scheduler.step()
        state.sizes = state.sizes + [td.size()]
        state.step += 1
        if diverge is not None and (worker, state.step) == diverge:
            state.step += 1
        if die_before_commit is not None and (worker, state.step - 1) == die_before_commit:
            os._exit(9)
        if not args.no_commit and (worker, state.step) != skip:
            state.commit()


train(state)
params = {k: v.clone() for k, v in model.state_dict().items()}  # collective when sharded
if td.rank() == 0:
    torch.save({"params": params, "lr": inner.param_groups[0]["lr"],
                "sizes": state.sizes, "step": state.step}, args.out)
td.shutdown()
