"""Data-parallel training that one process can check, and where each rank ran, for multi-host tests.

    tandem run -np 4 -H h1:2,h2:2 cluster_train.py --out params.pt     # across hosts
    python cluster_train.py --out reference.pt                          # one process
    tandem run --max-restarts 1 ... cluster_train.py --checkpoint DIR    # resumes where it was

Every step takes the next `--batch` rows of one fixed data set; each of k ranks trains on its
1/k of them (float64, mean loss, equal shards), so k ranks end with the parameters of one
process that trains on all of them (tandem's correctness contract). Rank 0 writes the flat
parameters to --out. Each rank writes `<out>.where.<rank>.json` (and prints it as `where {json}`):
its rank, the job's size and backend, its hostname, which tandem it imported, and the TCP
sockets it holds (local and remote address, state) read from /proc, so a test can check that
the ranks bind and connect on their hosts' addresses. The tests read the files: a launcher that
forwards several ranks' output (MPICH's Hydra) may join two ranks' lines into one.
"""

import argparse
import json
import os
import socket
import time

import torch
from torch import nn

import tandem as td

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=32, help="global batch")
parser.add_argument("--out")
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--checkpoint", help="save after every step, resume from the last one")
args = parser.parse_args()

world = td.init()
rank, size = td.rank(), td.size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters())
td.broadcast_parameters(model)
checkpoints = td.Checkpointer(args.checkpoint, every=1, keep=2) if args.checkpoint else None
start = checkpoints.restore(model=model, optimizer=opt) if checkpoints else 0
generator = torch.Generator().manual_seed(1)
x = torch.randn(args.steps * args.batch, 8, generator=generator, dtype=torch.float64)
y = x.sum(dim=1, keepdim=True).sin()
share = args.batch // size
for step in range(start, args.steps):
    rows = slice(step * args.batch + rank * share, step * args.batch + (rank + 1) * share)
    opt.zero_grad()
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    if checkpoints:
        checkpoints.save(step, model=model, optimizer=opt)
    if rank == 0:
        print(f"step {step}", flush=True)
    if args.step_seconds:
        time.sleep(args.step_seconds)


def tcp_sockets() -> list[dict]:
    """This process's IPv4 TCP sockets: [{"local": "a:p", "remote": "b:q", "state": "01"}]."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def address(text: str) -> str:
        host, port = text.split(":")
        return f"{socket.inet_ntoa(bytes.fromhex(host)[::-1])}:{int(port, 16)}"

    found = []
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[9] in inodes:
                found.append({"local": address(fields[1]), "remote": address(fields[2]),
                              "state": fields[3]})
    return found


where = json.dumps({"rank": rank, "size": size, "backend": world.backend,
                    "host": socket.gethostname(), "tandem": td.__file__, "sockets": tcp_sockets()})
print("where " + where, flush=True)
if args.out:
    with open(f"{args.out}.where.{rank}.json", "w") as record:
        record.write(where)
if rank == 0 and args.out:
    torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), args.out)
td.shutdown()
