"""torch.compile against eager at 2 ranks: step time and exposed communication; and the
activation memory that `td.memory.checkpoint_wrapper` saves.

    python benchmarks/compile_overlap.py                     # MLP and ResNet-9, Gloo, CPU
    python benchmarks/compile_overlap.py --steps 10 --models mlp --out /tmp/co.json

Part 1, 2 ranks (`td.spawn`, Gloo, one thread per rank). Each model is trained four ways,
alternating step by step after warm-up (which includes compiling):
- `ddp eager` / `ddp compiled`: `td.DistributedDataParallel(model)`, and `torch.compile` of it
  (the graph cut at the gradient buckets, `parallel/data_parallel/compile_split.py`);
- `opt eager` / `opt compiled`: `td.DistributedOptimizer` over the plain model, and
  `torch.compile(model)` under it (cut at the optimizer's buckets: its cut stands while it
  lives);
- MLP only, `tp eager` / `tp compiled`: the MLP split by `td.parallelize` (first layer
  column-parallel, second row-parallel) over both ranks, which then compute the same batch;
  compiled, the regions' collectives are custom operators inside the one graph. Its
  communication is part of the forward and backward, not hidden behind them: step time only.
Exposed communication is tandem's own compute/communication split: the time the step waited
for gradient reductions that backward did not hide (`last_step_stats.comm_wait_s`, what
`tandem scale` reports). The exposed share is that wait over the step's wall time (summed over
the measured steps, averaged over the ranks); the target is compiled <= 1.1 x eager.

Part 2, one process: activation memory with and without checkpointing each block
(`td.memory.checkpoint_wrapper(model, policy=Block)`) for ResNet-9 (residual and conv-BN blocks) and
a small GPT (its transformer blocks). Memory is the heap in use right after forward (loss
computed, autograd graph alive) minus before it, from glibc's `mallinfo2()` (torch's CPU
tensors are malloc'd; CPU torch has no allocator statistics of its own); also the step time.

Numbers are from whatever machine runs it; the README's come from the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.bench import models
from tandem.bench.results import write_json

BATCH = {"mlp": 64, "resnet9": 16}  # per rank


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return models.mlp(784, 2048, 2048, 10) if name == "mlp" else models.resnet9()


def batch(name: str, rows: int):
    g = torch.Generator().manual_seed(td.rank() if td.is_initialized() else 0)
    shape = (rows, 784) if name == "mlp" else (rows, 3, 32, 32)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (rows,), generator=g)


def variants(name: str) -> dict:
    """{variant: (step closure, the object whose last_step_stats has the wait)}."""
    out = {}
    x, y = batch(name, BATCH[name])
    for compiled in (False, True):
        model = build(name)
        wrapped = td.DistributedDataParallel(model)
        run = torch.compile(wrapped) if compiled else wrapped
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def ddp_step(run=run, opt=opt):
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
        out[f"ddp {'compiled' if compiled else 'eager'}"] = (ddp_step, wrapped)

        model = build(name)
        run = torch.compile(model) if compiled else model
        opt = td.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters())

        def opt_step(run=run, opt=opt):
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
        out[f"opt {'compiled' if compiled else 'eager'}"] = (opt_step, opt)
        if name == "mlp":
            out[f"tp {'compiled' if compiled else 'eager'}"] = (_tensor_parallel_step(compiled), None)
    return out


class _Split(nn.Module):
    """The MLP under a module of its own: torch.compile runs the parallelized model's hooks
    (its agreement) outside the graph, which it does not for an `nn.Sequential` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = build("mlp")

    def forward(self, x):
        return self.mlp(x)


def _tensor_parallel_step(compiled: bool):
    model = td.parallelize(_Split(), {"mlp.0": "colwise", "mlp.2": "rowwise"})
    run = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank of the split
    x, y = torch.randn(BATCH["mlp"], 784, generator=g), torch.randint(0, 10, (BATCH["mlp"],), generator=g)

    def step():
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        opt.step()
    return step


def overlap_worker(config: dict) -> list[dict]:
    torch.set_num_threads(1)
    results = {}
    for name in config["models"]:
        steps = variants(name)
        compile_s = {}
        for variant, (step, _) in steps.items():
            start = time.perf_counter()
            for _ in range(config["warmup"]):
                step()
            compile_s[variant] = time.perf_counter() - start
        wall = {v: [] for v in steps}
        wait = {v: [] for v in steps}
        names = list(steps)
        for i in range(config["steps"]):
            for variant in names[i % len(names):] + names[: i % len(names)]:
                step, owner = steps[variant]
                td.barrier()
                start = time.perf_counter()
                step()
                wall[variant].append(time.perf_counter() - start)
                wait[variant].append(owner.last_step_stats.comm_wait_s if owner else 0.0)
        results[name] = {v: {"step_s": statistics.median(wall[v]),
                             "exposed_share": sum(wait[v]) / sum(wall[v]),
                             "exposed_s": statistics.median(wait[v]),
                             "warmup_s": compile_s[v]} for v in steps}
    return td.allgather_object(results)


# -- activation memory -------------------------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(field, ctypes.c_size_t) for field in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_in_use() -> int:
    """Bytes malloc has handed out and not taken back (small blocks and mmap'd ones)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def memory_models() -> dict:
    def resnet_blocks(module: nn.Module) -> bool:
        return type(module).__name__ == "_Residual" or (
            isinstance(module, nn.Sequential) and len(module) and isinstance(module[0], nn.Conv2d))

    torch.manual_seed(0)
    gpt = models.gpt(vocab=4096, dim=256, heads=4, layers=4, seq=256)
    gpt_block = type(gpt.blocks[0])
    return {
        "resnet9": (models.resnet9, resnet_blocks,
                    lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))),
        "gpt": (lambda: models.gpt(vocab=4096, dim=256, heads=4, layers=4, seq=256), gpt_block,
                lambda: (torch.randint(0, 4096, (8, 256)), torch.randint(0, 4096, (8 * 256,)))),
    }


def activation_memory(steps: int) -> dict:
    """Plain and checkpointed copies of each model, their steps alternating (a load that drifts
    hits both alike); the first step of each is not counted."""
    torch.set_num_threads(1)
    out = {}
    for name, (make, policy, data) in memory_models().items():
        x, y = data()
        nets = {}
        for kind in ("plain", "checkpointed"):
            torch.manual_seed(0)
            nets[kind] = make()
            if kind == "checkpointed":
                td.memory.checkpoint_wrapper(nets[kind], policy=policy)
        held = {kind: [] for kind in nets}
        times = {kind: [] for kind in nets}
        for _ in range(steps + 1):
            for kind, model in nets.items():
                model.zero_grad(set_to_none=True)
                before = heap_in_use()
                start = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                held[kind].append(heap_in_use() - before)
                loss.backward()
                times[kind].append(time.perf_counter() - start)
                del loss
        out[name] = {kind: {"activation_mb": statistics.median(held[kind][1:]) / 2**20,
                            "step_s": statistics.median(times[kind][1:])} for kind in nets}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet9")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--out", default="results/compile_overlap.json")
    args = parser.parse_args()
    config = {"models": args.models.split(","), "steps": args.steps, "warmup": args.warmup}
    everyone = td.spawn(overlap_worker, nprocs=2, args=(config,), backend="gloo")[0]
    print(f"2 ranks, Gloo, 1 thread each; median step over {args.steps} steps; exposed share = "
          f"communication waited for / step time")
    print(f"{'model':<9}{'variant':<14}{'step ms':>9}{'exposed ms':>11}{'exposed share':>14}"
          f"{'time/eager':>11}{'share/eager':>12}{'warm-up s':>10}")
    overlap = {}
    for name in config["models"]:
        rows = {}
        for variant in everyone[0][name]:
            per_rank = [r[name][variant] for r in everyone]
            rows[variant] = {key: statistics.mean(r[key] for r in per_rank) for key in per_rank[0]}
        for variant, row in rows.items():
            eager = rows[variant.split()[0] + " eager"]
            row["time_over_eager"] = row["step_s"] / eager["step_s"]
            row["share_over_eager"] = (row["exposed_share"] / eager["exposed_share"]
                                       if eager["exposed_share"] > 0 else float("nan"))
            print(f"{name:<9}{variant:<14}{row['step_s'] * 1e3:>9.1f}{row['exposed_s'] * 1e3:>11.1f}"
                  f"{row['exposed_share']:>14.3f}{row['time_over_eager']:>11.2f}"
                  f"{row['share_over_eager']:>12.2f}{row['warmup_s']:>10.1f}")
        overlap[name] = rows
    memory = activation_memory(args.memory_steps)
    print("\nactivation memory (heap in use after forward minus before, glibc mallinfo2), one "
          "process, 1 thread")
    print(f"{'model':<9}{'plain MB':>10}{'checkpointed MB':>16}{'ratio':>7}{'step ms':>9}"
          f"{'ckpt step ms':>13}{'time ratio':>11}")
    for name, row in memory.items():
        plain, ckpt = row["plain"], row["checkpointed"]
        row["memory_ratio"] = ckpt["activation_mb"] / plain["activation_mb"]
        row["time_ratio"] = ckpt["step_s"] / plain["step_s"]
        print(f"{name:<9}{plain['activation_mb']:>10.1f}{ckpt['activation_mb']:>16.1f}"
              f"{row['memory_ratio']:>7.2f}{plain['step_s'] * 1e3:>9.1f}{ckpt['step_s'] * 1e3:>13.1f}"
              f"{row['time_ratio']:>11.2f}")
    write_json({"config": config, "torch": torch.__version__, "overlap": overlap,
                "activation_memory": memory}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
