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
gradients, optimizer state, and the wrapper's own buffers: ZeroOptimizer's shard and its
gradient; CPU has no allocator statistics), and "during a step" adds what a step holds at once
beyond them: ZeroOptimizer's flat gradient buffer in `step()`, and for `td.fully_shard` the
gathered units plus the padded gradients whose reduce-scatter is in flight (sampled around
every module's forward and backward, at each unit's gradient, and at the end of backward).
torch's DDP runs with `gradient_as_bucket_view=True`, so its gradients are its buckets.
Each is compared with `td.memory.estimate_memory` (measured / estimated, target within 10 %):
the benchmark holds no formula of its own. Step time: the methods alternate step by step,
median over `--steps` after warm-up. Ratios are to DDP and, for fully_shard, to FSDP2. JSON
goes to `results/sharding.json`.
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


def tp_plan(config: dict) -> dict[str, str]:
    """The blocks' Linear layers in colwise/rowwise pairs (an odd last block stays whole)."""
    pairs = config["blocks"] - config["blocks"] % 2
    return {f"{i}.0": "colwise" if i % 2 == 0 else "rowwise" for i in range(pairs)}


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
            "optimizer": _bytes(v for s in inner.state.values() for v in s.values()),
            # ZeroOptimizer's shard of the parameters and of the averaged gradient
            "buffers": _bytes([getattr(optimizer, "_shard", None),
                               getattr(optimizer, "_shard_grad", None)])}


def estimates(config: dict, n: int) -> dict[str, td.memory.MemoryEstimate]:
    """What `td.memory.estimate_memory` says for each method (FSDP2 as td.fully_shard)."""
    with torch.device("meta"):
        net = model(config)
    blocks = list(net)[:-1]
    out = {"ddp": td.memory.estimate_memory(net, world_size=n, layout="ddp"),
           "zero": td.memory.estimate_memory(net, world_size=n, layout="zero"),
           "fully_shard": td.memory.estimate_memory(net, world_size=n, layout="fully_shard", units=blocks),
           "pipeline": td.memory.estimate_memory(net, world_size=n, layout="pipeline", balance="params"),
           "tp": td.memory.estimate_memory(net, world_size=n, layout="tp", plan=tp_plan(config))}
    out["fsdp2"] = out["fully_shard"]
    return out


class StepPeak:
    """The most bytes of gathered units and in-flight gradient reductions of a td.fully_shard
    model alive at once: sampled around every module's forward and backward, when each unit's
    gradient arrives (before it is packed for its reduce-scatter) and at the end of backward
    (before the reduce-scatters are waited for)."""

    def __init__(self, net: nn.Module) -> None:
        self.units = [unit for _, unit in units(net)]
        self.peak = 0
        for module in net.modules():
            module.register_forward_pre_hook(lambda *a: self.sample())
            module.register_forward_hook(lambda *a: self.sample())
            module.register_full_backward_pre_hook(lambda *a: self.sample())
        for unit in self.units:
            unit.module.register_forward_hook(lambda module, args, out, unit=unit: self.watch(unit))
        net.register_forward_hook(self.at_end_of_backward)

    def at_end_of_backward(self, module, args, out) -> None:
        """Queued at the output's gradient, so it runs before the units' end-of-backward wait."""
        queue = torch.autograd.Variable._execution_engine.queue_callback
        out.register_hook(lambda grad: queue(self.sample))

    def watch(self, unit) -> None:
        if unit._full is not None and unit._full.requires_grad:
            unit._full.register_hook(lambda grad: self.sample(grad.untyped_storage().nbytes()))

    def sample(self, extra: int = 0) -> None:
        storages = {}
        for unit in self.units:
            pending = unit.reduction._pending
            reducing = pending[1] if pending is not None else None
            if isinstance(reducing, tuple):  # HSDP: (the output, its staged copy)
                reducing = reducing[0]
            for t in (unit._full, unit.reduction._input, reducing):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(storages.values()) + extra)


def flat_buffer_peak(optimizer: td.ZeroOptimizer) -> dict[str, int]:
    """The bytes of ZeroOptimizer's flat gradient buffer, recorded as step() makes it."""
    seen = {"peak": 0}
    pack = optimizer._pack_gradients

    def measured():
        flat = pack()
        seen["peak"] = max(seen["peak"], flat.untyped_storage().nbytes())
        return flat
    optimizer._pack_gradients = measured
    return seen


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

    net = (nn.parallel.DistributedDataParallel(model(config), gradient_as_bucket_view=True)
           if td.size() > 1 else model(config))
    add("ddp", net, torch.optim.Adam(net.parameters(), lr=1e-3))
    net = model(config)
    zero = td.ZeroOptimizer(torch.optim.Adam(net.parameters(), lr=1e-3))
    objects["zero_peak"] = flat_buffer_peak(zero)
    add("zero", net, zero)
    net = model(config)
    for block in list(net)[:-1]:
        td.fully_shard(block)
    td.fully_shard(net)
    objects["fully_shard_peak"] = StepPeak(net)
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
        during = {"fully_shard": lambda: objects["fully_shard_peak"].peak,
                  "zero": lambda: objects["zero_peak"]["peak"]}.get(name, lambda: 0)()
        memory["peak"] = memory["total"] + during
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
    print(f"{'ranks':>5} {'method':<12} {'state MB/rank':>13} {'estimated':>9} {'meas/est':>8} "
          f"{'peak MB/rank':>12} {'estimated':>9} {'meas/est':>8} {'vs ddp':>7} {'step ms':>8} "
          f"{'time/ddp':>9} {'time/fsdp2':>10}")
    for n in (int(r) for r in args.ranks.split(",")):
        everyone = td.spawn(worker, nprocs=n, args=(config,), backend="gloo")[0]
        rank0 = everyone[0]
        estimated = estimates(config, n)
        # Memory: the largest over ranks (shards are padded, the last may be smaller).
        table = {}
        for name in rank0["methods"]:
            peak = max(r["methods"][name]["memory"]["peak"] for r in everyone)
            total = max(r["methods"][name]["memory"]["total"] for r in everyone)
            table[name] = {"state_mb": total / 2**20, "peak_mb": peak / 2**20,
                           "step_ms": 1000 * max(r["methods"][name]["step_s"] for r in everyone),
                           "memory": [r["methods"][name]["memory"] for r in everyone]}
        for name, row in table.items():
            estimate = estimated[name]
            row["memory_over_ddp"] = row["peak_mb"] / table["ddp"]["peak_mb"]
            row["estimated_mb"] = estimate.total / 2**20
            row["measured_over_estimated"] = row["state_mb"] / row["estimated_mb"]
            # FSDP2's step is not sampled: its peak is not compared
            row["estimated_peak_mb"] = float("nan") if name == "fsdp2" else estimate.peak / 2**20
            row["peak_measured_over_estimated"] = row["peak_mb"] / row["estimated_peak_mb"]
            row["time_over_ddp"] = row["step_ms"] / table["ddp"]["step_ms"]
            if "fsdp2" in table:
                row["time_over_fsdp2"] = row["step_ms"] / table["fsdp2"]["step_ms"]
            print(f"{n:>5} {name:<12} {row['state_mb']:>13.2f} {row['estimated_mb']:>9.2f} "
                  f"{row['measured_over_estimated']:>8.3f} {row['peak_mb']:>12.2f} "
                  f"{row['estimated_peak_mb']:>9.2f} {row['peak_measured_over_estimated']:>8.3f} "
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
