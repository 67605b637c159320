"""Per-rank memory and step time: DDP, ZeroOptimizer, td.fully_shard, torch's FSDP2, td.Pipeline
and td.parallelize, against the README's "Which wrapper?" formulas.

    python benchmarks/sharding.py                           # 1, 2 and 4 ranks, Gloo, CPU
    python benchmarks/sharding.py --ranks 2 --steps 10 --width 256

One world per rank count (`td.spawn`, Gloo); in it, every method trains its own copy of the
same model (`--blocks` Linear(width, width)+ReLU blocks and a head; each block one unit for
the sharded methods, the root last) with Adam, per-rank batch 32, one thread per rank:
- `ddp`: torch's DistributedDataParallel (every rank: all parameters, gradients, state);
- `zero`: `td.ZeroOptimizer` on `td.DistributedDataParallel`-free plain backward (state 1/N);
- `fully_shard`: `td.fully_shard` per block and the root (parameters, gradients, state 1/N);
- `fsdp2`: `torch.distributed.fsdp.fully_shard`, the same wrapping, when it runs on CPU/Gloo
  (if it does not, its error is reported and the comparison is with DDP);
- `pipeline`: `td.Pipeline` over every rank (`balance="params"`, 4 micro-batches): each rank its
  stage's layers, parameters, gradients and state (the largest stage is the one reported);
- `tp`: `td.parallelize` over every rank, the blocks' Linear layers in colwise/rowwise pairs
  (a row-parallel layer keeps its bias whole), the head replicated; every rank the same batch.

Memory per rank is counted from the tensors each method keeps between steps (parameters,
gradients, optimizer state: CPU has no allocator statistics), and for the sharded methods the
peak adds the largest sum of gathered units alive at once during a step (sampled around every
module's forward and backward). Step time: the methods alternate step by step, median over
`--steps` after warm-up. Ratios are to DDP and, for fully_shard, to FSDP2. JSON goes to
`results/sharding.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.bench.results import write_json
from tandem.parallel.fully_shard import units

BATCH = 32


def model(config: dict) -> nn.Sequential:
    torch.manual_seed(0)
    width = config["width"]
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(config["blocks"])]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


# The README's table: bytes per rank kept between steps, fp32 parameters with Adam (two moments),
# P parameters over N ranks. The benchmark prints measured / predicted (target within 10 %).
PREDICTED = {
    "ddp": lambda p, n, split: 16 * p,               # parameters 4P, gradients 4P, Adam 8P
    "zero": lambda p, n, split: 8 * p + 8 * p / n,   # parameters and gradients whole, Adam sharded
    "fully_shard": lambda p, n, split: 16 * p / n,   # everything sharded (+ padding to N)
    "fsdp2": lambda p, n, split: 16 * p / n,
    "pipeline": lambda p, n, split: 16 * p / n,      # balanced stages; layers come whole
    "tp": lambda p, n, split: 16 * split / n + 16 * (p - split),
}


def tp_plan(config: dict) -> dict[str, str]:
    """The blocks' Linear layers in colwise/rowwise pairs (an odd last block stays whole)."""
    pairs = config["blocks"] - config["blocks"] % 2
    return {f"{i}.0": "colwise" if i % 2 == 0 else "rowwise" for i in range(pairs)}


def split_parameters(config: dict) -> int:
    """P_split of the README's tp row: every split weight, and the column-parallel biases."""
    width = config["width"]
    return sum(width * width + (width if style == "colwise" else 0)
               for style in tp_plan(config).values())


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def state_bytes(net: nn.Module, optimizer) -> dict[str, int]:
    inner = getattr(optimizer, "optimizer", optimizer)
    params = list(net.parameters())
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optimizer": _bytes(v for s in inner.state.values() for v in s.values())}


class GatheredPeak:
    """The most bytes of gathered (unsharded) units alive at once, sampled around modules."""

    def __init__(self, net: nn.Module) -> None:
        self.units = [unit for _, unit in units(net)]
        self.peak = 0
        for module in net.modules():
            module.register_forward_pre_hook(lambda *a: self.sample())
            module.register_forward_hook(lambda *a: self.sample())
            module.register_full_backward_pre_hook(lambda *a: self.sample())

    def sample(self) -> None:
        alive = sum(u._full.untyped_storage().size() for u in self.units if u._full is not None)
        self.peak = max(self.peak, alive)


def methods(config: dict) -> tuple[dict, dict, dict]:
    """{name: step closure}, {name: (model, optimizer)}, {name: error} for what did not run."""
    steps, objects, errors = {}, {}, {}
    g = torch.Generator().manual_seed(td.rank())
    x, y = torch.randn(BATCH, config["width"], generator=g), torch.randint(0, 10, (BATCH,), generator=g)

    def add(name, net, optimizer):
        def step():
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        steps[name], objects[name] = step, (net, optimizer)

    net = nn.parallel.DistributedDataParallel(model(config)) if td.size() > 1 else model(config)
    add("ddp", net, torch.optim.Adam(net.parameters(), lr=1e-3))
    net = model(config)
    add("zero", net, td.ZeroOptimizer(torch.optim.Adam(net.parameters(), lr=1e-3)))
    net = model(config)
    for block in list(net)[:-1]:
        td.fully_shard(block)
    td.fully_shard(net)
    objects["peak"] = GatheredPeak(net)
    add("fully_shard", net, torch.optim.Adam(net.parameters(), lr=1e-3))
    try:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        net = model(config)
        for block in list(net)[:-1]:
            torch_fully_shard(block)
        torch_fully_shard(net)
        add("fsdp2", net, torch.optim.Adam(net.parameters(), lr=1e-3))
        steps["fsdp2"]()  # fails here if FSDP2 cannot run on this device/backend
    except Exception as error:  # reported in the table, compared with DDP instead
        steps.pop("fsdp2", None)
        errors["fsdp2"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    # pipeline stages and tensor-parallel ranks all see the same batch
    g = torch.Generator().manual_seed(0)
    same_x = torch.randn(BATCH, config["width"], generator=g)
    same_y = torch.randint(0, 10, (BATCH,), generator=g)
    pipe = td.Pipeline(model(config), chunks=4, balance="params")
    pipe_optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)

    def pipeline_step():
        pipe_optimizer.zero_grad(set_to_none=False)
        pipe.train_step(same_x, same_y, F.cross_entropy)
        pipe_optimizer.step()
    steps["pipeline"], objects["pipeline"] = pipeline_step, (pipe, pipe_optimizer)
    net = td.parallelize(model(config), tp_plan(config))
    tp_optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)

    def tp_step():
        tp_optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(net(same_x), same_y).backward()
        tp_optimizer.step()
    steps["tp"], objects["tp"] = tp_step, (net, tp_optimizer)
    return steps, objects, errors


def worker(config: dict) -> dict | None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    steps, objects, errors = methods(config)
    names = list(steps)
    for name in names:
        for _ in range(config["warmup"]):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(config["steps"]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            td.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    out = {"errors": errors, "methods": {}}
    for name in names:
        memory = state_bytes(*objects[name])
        memory["total"] = sum(memory.values())
        memory["peak"] = memory["total"] + (objects["peak"].peak if name == "fully_shard" else 0)
        out["methods"][name] = {"memory": memory, "step_s": statistics.median(times[name])}
    everyone = td.allgather_object(out)
    return everyone if td.rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="results/sharding.json")
    args = parser.parse_args()
    config = {"blocks": args.blocks, "width": args.width, "steps": args.steps, "warmup": args.warmup}
    results = {"config": config, "torch": torch.__version__, "worlds": {}}
    print(f"{args.blocks} blocks of Linear({args.width}, {args.width}) + head, Adam, per-rank batch {BATCH}")
    print(f"{'ranks':>5} {'method':<12} {'state MB/rank':>13} {'predicted':>9} {'meas/pred':>9} "
          f"{'peak MB/rank':>12} {'vs ddp':>7} {'step ms':>8} {'time/ddp':>9} {'time/fsdp2':>10}")
    parameters = sum(p.numel() for p in model(config).parameters())
    split = split_parameters(config)
    for n in (int(r) for r in args.ranks.split(",")):
        everyone = td.spawn(worker, nprocs=n, args=(config,), backend="gloo")[0]
        rank0 = everyone[0]
        # Memory: the largest over ranks (shards are padded, the last may be smaller).
        table = {}
        for name in rank0["methods"]:
            peak = max(r["methods"][name]["memory"]["peak"] for r in everyone)
            total = max(r["methods"][name]["memory"]["total"] for r in everyone)
            table[name] = {"state_mb": total / 2**20, "peak_mb": peak / 2**20,
                           "step_ms": 1000 * max(r["methods"][name]["step_s"] for r in everyone),
                           "memory": [r["methods"][name]["memory"] for r in everyone]}
        for name, row in table.items():
            row["memory_over_ddp"] = row["peak_mb"] / table["ddp"]["peak_mb"]
            row["predicted_mb"] = PREDICTED[name](parameters, n, split) / 2**20
            row["measured_over_predicted"] = row["state_mb"] / row["predicted_mb"]
            row["time_over_ddp"] = row["step_ms"] / table["ddp"]["step_ms"]
            if "fsdp2" in table:
                row["time_over_fsdp2"] = row["step_ms"] / table["fsdp2"]["step_ms"]
            print(f"{n:>5} {name:<12} {row['state_mb']:>13.2f} {row['predicted_mb']:>9.2f} "
                  f"{row['measured_over_predicted']:>9.3f} {row['peak_mb']:>12.2f} "
                  f"{row['memory_over_ddp']:>7.2f} {row['step_ms']:>8.1f} {row['time_over_ddp']:>9.2f} "
                  f"{row.get('time_over_fsdp2', float('nan')):>10.2f}")
        for name, error in rank0["errors"].items():
            print(f"{n:>5} {name:<12} did not run: {error}")
        results["worlds"][n] = {"methods": table, "errors": rank0["errors"]}
    write_json(results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if dist.is_available():
        main()
