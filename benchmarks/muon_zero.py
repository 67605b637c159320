"""Muon's optimizer step sharded by whole parameters (td.ZeroOptimizer) against replicated.

    python benchmarks/muon_zero.py                          # 2 ranks, Gloo, CPU
    python benchmarks/muon_zero.py --ranks 2 --layers 8 --width 512 --steps 10

Muon orthogonalizes each whole matrix (Newton-Schulz iterations, a few matrix products per
parameter per step): it is not element-wise, so td.ZeroOptimizer gives each parameter whole to
one rank (balanced by size), which steps it, and all-gathers the new values. Replicated
(`td.DistributedOptimizer`): every rank orthogonalizes every matrix. One world (`td.spawn`,
Gloo, one thread per rank); the model is `--layers` Linear(width, width) without bias (Muon
steps 2-D parameters), per-rank batch 32. The two alternate step by step; reported per rank:

- `step ms`: median time of `optimizer.step()` after backward (ZeroOptimizer: the
  reduce-scatter of the gradients, Muon on this rank's matrices, the all-gather of the values;
  replicated: the wait for the gradients' all-reduce, Muon on every matrix), the slowest rank;
- `step+backward ms`: backward and step together (the replicated all-reduce overlaps backward);
- `step CPU ms`: the processor time of `optimizer.step()` in this rank's process (one thread:
  the work itself, which a machine shared with other jobs does not inflate as it does the wall
  time; waiting on a peer costs little of it);
- `state MB/rank`: Muon's momentum buffers held by each rank (the largest over ranks).

Target: the sharded step <= 0.6x the replicated one at 2 ranks (both ratios are reported).
What the sharded step adds: its reduce-scatter and all-gather (the replicated all-reduce runs
under backward instead). On Gloo over loopback (CPU) that is a fixed cost per element against
Muon's cubic one per matrix, so small matrices miss the target: measured on the shared 2-core
machine, width 512 x 8 layers gave 0.84-0.95 of the replicated step (CPU 0.86), width 1024 x 4
0.82 (CPU 0.73), the default width 2048 x 4 0.50-0.73 (CPU 0.65-0.69, load average 14-30);
the state per rank halves in every case. The parameters come out the same (the largest
difference is printed). JSON goes to `results/muon_zero.json`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.bench.results import write_json

BATCH = 32


def model(config: dict) -> nn.Sequential:
    torch.manual_seed(0)
    width = config["width"]
    layers = []
    for _ in range(config["layers"]):
        layers += [nn.Linear(width, width, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def state_bytes(optimizer) -> int:
    inner = optimizer.optimizer
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
               if torch.is_tensor(v))


def worker(config: dict) -> dict:
    torch.set_num_threads(1)
    td.init()
    built = {}
    for name in ("replicated", "zero"):
        net = model(config)
        inner = torch.optim.Muon(net.parameters(), lr=0.02)
        wrapper = td.ZeroOptimizer if name == "zero" else td.DistributedOptimizer
        built[name] = (net, wrapper(inner))
    times = {name: {"step": [], "both": [], "cpu": []} for name in built}
    generator = torch.Generator().manual_seed(td.rank())
    for step in range(config["warmup"] + config["steps"]):
        x = torch.randn(BATCH, config["width"], generator=generator)
        for name, (net, optimizer) in built.items():
            optimizer.zero_grad()
            loss = F.mse_loss(net(x), x)
            td.barrier()
            start = time.perf_counter()
            loss.backward()
            middle, cpu = time.perf_counter(), time.process_time()
            optimizer.step()
            end, cpu = time.perf_counter(), time.process_time() - cpu
            if step >= config["warmup"]:
                times[name]["cpu"].append(cpu)
                times[name]["step"].append(end - middle)
                times[name]["both"].append(end - start)
    same = max((a - b).abs().max().item() for a, b in
               zip(built["zero"][0].parameters(), built["replicated"][0].parameters(), strict=True))
    return {"times": {name: {k: statistics.median(v) for k, v in t.items()}
                      for name, t in times.items()},
            "state": {name: state_bytes(optimizer) for name, (_, optimizer) in built.items()},
            "difference": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="results/muon_zero.json")
    args = parser.parse_args()
    config = {"layers": args.layers, "width": args.width, "steps": args.steps,
              "warmup": args.warmup, "ranks": args.ranks}
    everyone = td.spawn(worker, nprocs=args.ranks, args=(config,), backend="gloo")
    table = {}
    for name in ("replicated", "zero"):
        table[name] = {
            "step_ms": 1000 * max(r["times"][name]["step"] for r in everyone),
            "step_backward_ms": 1000 * max(r["times"][name]["both"] for r in everyone),
            "step_cpu_ms": 1000 * max(r["times"][name]["cpu"] for r in everyone),
            "state_mb_per_rank": max(r["state"][name] for r in everyone) / 2**20,
        }
    ratio = table["zero"]["step_ms"] / table["replicated"]["step_ms"]
    cpu_ratio = table["zero"]["step_cpu_ms"] / table["replicated"]["step_cpu_ms"]
    print(f"{args.layers} x Linear({args.width}, {args.width}), Muon, {args.ranks} ranks, "
          f"per-rank batch {BATCH}")
    print(f"{'method':<12} {'step ms':>8} {'step+backward ms':>17} {'step CPU ms':>12} "
          f"{'state MB/rank':>14}")
    for name, row in table.items():
        print(f"{name:<12} {row['step_ms']:>8.1f} {row['step_backward_ms']:>17.1f} "
              f"{row['step_cpu_ms']:>12.1f} {row['state_mb_per_rank']:>14.2f}")
    difference = max(r["difference"] for r in everyone)
    print(f"sharded step / replicated step: {ratio:.2f} wall, {cpu_ratio:.2f} CPU (target <= "
          f"0.6); largest parameter difference between the two: {difference:.1e}")
    write_json({"config": config, "torch": torch.__version__, "methods": table,
                "step_ratio": ratio, "step_cpu_ratio": cpu_ratio, "difference": difference,
                "load_average": os.getloadavg(), "cpus": os.cpu_count()}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if dist.is_available():
        main()
