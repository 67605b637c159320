"""tandem's DistributedOptimizer against torch's DistributedDataParallel, in the same processes.

    python benchmarks/dp_vs_ddp.py                       # ResNet-9 and the MLP, 2 ranks, Gloo
    python benchmarks/dp_vs_ddp.py --models mlp --steps 30 --reps 5
    tandem run -np 2 benchmarks/dp_vs_ddp.py   # under a launcher (MPI by default on CPU): no spawning
    python benchmarks/dp_vs_ddp.py -np 1 --device cuda --dtype bf16 --models resnet9,gpt \
        --batch resnet9=256,gpt=8              # tandem's per-step overhead on one GPU

Both run on every rank of one world (started with `td.spawn`, or the launcher's), on
synthetic data, with the same per-rank batch (64 for the MLP 784-2048-2048-10, 32 for the
CIFAR ResNet-9, 8 sequences of 512 tokens for the GPT-style decoder of `tandem.bench.models`;
`--batch` changes them), SGD with momentum, one thread per rank. The methods (tandem, DDP, and one
process alone while the other ranks wait) alternate step by step, in an order that rotates,
so that slow phases of a shared machine hit each method alike; every step starts after an
(untimed) barrier. A repetition is `--steps` such rounds, summarised by each method's median
step time. Reported per method: the median over repetitions, as step time and samples/s
(global batch / step time), and the CPU time per step (all threads: steadier than wall time
on a shared machine). The ratio tandem / DDP of throughputs (> 1: tandem is faster) and the
weak-scaling efficiency (one-process step time / N-process step time, same per-rank batch)
are computed within each repetition, then the median is taken over repetitions (paired, so
that load drifting between repetitions cancels out). The table is printed and the numbers go
to JSON (`results/dp_vs_ddp.json` by default).

DDP runs with its defaults (25 MB buckets, gradients copied into buckets, buffers broadcast
each forward); `--ddp-views` adds a DDP with `gradient_as_bucket_view=True`. When tandem runs
on MPI (`tandem run -np 2 benchmarks/dp_vs_ddp.py`, MPI being the CPU default), DDP gets a Gloo process
group of its own in the same processes: tandem-on-MPI against DDP-on-Gloo; and a third method,
"ddp_tandem", is torch's DDP over torch's default group, which `td.init()` made tandem's
(backend "tandem" on the MPI engine, through the watchdog): what an unchanged DDP script gets
on MPI with `init_process_group("tandem")`.

`-np 1` runs a world of one in this process: "single" is then plain PyTorch, and the weak
efficiency of "tandem" (plain step time / tandem step time) measures what tandem adds to a
step by itself. `--device cuda` puts models and data on the GPU (the step's clock stops after
`torch.cuda.synchronize()`, so it counts the GPU's work); `--dtype bf16` runs forward and loss
under `torch.autocast(dtype=torch.bfloat16)`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tandem as td
from tandem.bench.models import gpt, mlp, resnet9
from tandem.bench.results import write_json
from tandem.job import environments

BATCH = {"mlp": 64, "resnet9": 32, "gpt": 8}  # per rank (gpt: sequences)
GPT = {"vocab": 32768, "dim": 1024, "heads": 16, "layers": 4, "seq": 512}


def build(name: str, config: dict) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(td.rank())
    batch, device = config["batch"][name], torch.device(config["device"])
    if name == "mlp":
        model = mlp(784, 2048, 2048, 10)
        x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    elif name == "gpt":
        model = gpt(**GPT)
        x = torch.randint(0, GPT["vocab"], (batch, GPT["seq"]), generator=g)
        y = torch.randint(0, GPT["vocab"], (batch * GPT["seq"],), generator=g)
    else:
        model = resnet9(num_classes=10)
        x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model.to(device), x.to(device), y.to(device)


def autocast(config: dict):
    """bf16 autocast for forward and loss when asked, else nothing."""
    if config["dtype"] == "bf16":
        return torch.autocast(torch.device(config["device"]).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def steppers(name: str, config: dict) -> dict:
    """One `step()` closure per method, each with its own model and optimizer."""
    methods = {}
    model, x, y = build(name, config)
    opt = td.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                  bucket_mb=config["bucket_mb"], first_bucket_mb=config["first_bucket_mb"])

    def loss_of(model):
        with autocast(config):
            return F.cross_entropy(model(x), y)

    def tandem_step(model=model, opt=opt):
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()

    methods["tandem"] = tandem_step
    if dist.is_available() and dist.is_initialized():
        gloo = config.get("gloo_group")  # DDP's Gloo group beside tandem's MPI one
        variants = {"ddp": {"process_group": gloo}}
        if config["ddp_views"]:
            variants["ddp_views"] = {"gradient_as_bucket_view": True, "process_group": gloo}
        if gloo is not None:
            variants["ddp_tandem"] = {}  # torch's default group: backend "tandem" (MPI)
        for label, options in variants.items():
            model, _, _ = build(name, config)
            wrapped = torch.nn.parallel.DistributedDataParallel(model, **options)
            opt = sgd(wrapped)

            def ddp_step(wrapped=wrapped, opt=opt):
                opt.zero_grad()
                loss_of(wrapped).backward()
                opt.step()

            methods[label] = ddp_step
    model, _, _ = build(name, config)
    opt = sgd(model)

    def single_step(model=model, opt=opt):
        # One process alone: rank 0 trains, the other ranks wait at the barrier after it.
        if td.rank() == 0:
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()

    methods["single"] = single_step
    return methods


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_step(step, alone: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one step on rank 0, all ranks starting together (barrier untimed).

    CPU time is this process's, all threads (Gloo's included): on a machine shared with other
    jobs it varies much less than wall time, so it shows the work each method does. On a GPU
    the step's queued work is finished before the clock starts and before it stops.
    """
    _synchronize()
    td.barrier()
    if alone and td.rank() != 0:
        td.barrier()  # the other ranks wait while rank 0 trains alone
        return float("nan"), float("nan")
    start, cpu = time.perf_counter(), time.process_time()
    step()
    _synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    if alone:
        td.barrier()
    return seconds, cpu_seconds


def gloo_group_for_ddp() -> dist.ProcessGroup | None:
    """When tandem runs on MPI, give DDP the torch Gloo process group it needs, beside it
    (None otherwise: DDP then runs on torch's default group, tandem's own Gloo or NCCL).

    That is the comparison users face: tandem over MPI against DDP over Gloo, same processes.
    torch's default group is tandem's there (td.init made it), and `dist.new_group` is handed to
    that group, which makes tandem groups: the Gloo group comes from torch's own helper.
    """
    if td.init().backend != "mpi":
        return None
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from tandem import rendezvous

    store = rendezvous.host_store("127.0.0.1", 0) if td.rank() == 0 else None
    port = td.broadcast_object(store.port if store else None)
    if store is None:
        store = rendezvous.connect_store("127.0.0.1", port)
    ranks = list(range(td.size()))
    group, _ = c10d._new_process_group_helper(td.size(), td.rank(), ranks, "gloo", store,
                                              "dp_vs_ddp_gloo", timeout=timedelta(minutes=10))
    c10d._world.pg_group_ranks[group] = {r: r for r in ranks}
    return group


def worker(config: dict) -> dict | None:
    torch.set_num_threads(config["threads"])
    config = {**config, "gloo_group": gloo_group_for_ddp()}
    out: dict = {}
    for name in config["models"]:
        methods = steppers(name, config)
        labels = list(methods)
        for label in labels:  # warm-up: allocations, DDP's bucket rebuild
            for _ in range(config["warmup"]):
                timed_step(methods[label], alone=label == "single")
        # Methods alternate step by step (the order rotating), so that a busy moment of a
        # shared machine slows all of them alike; a repetition is `steps` such rounds.
        per_rep: dict[str, list[float]] = {label: [] for label in labels}
        cpu_per_rep: dict[str, list[float]] = {label: [] for label in labels}
        for rep in range(config["reps"]):
            times: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
            for i in range(config["steps"]):
                shift = (i + rep) % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    times[label].append(timed_step(methods[label], alone=label == "single"))
            for label in labels:
                per_rep[label].append(statistics.median(t[0] for t in times[label]))
                cpu_per_rep[label].append(statistics.median(t[1] for t in times[label]))
        out[name] = {"wall": per_rep, "cpu": cpu_per_rep, "batch": config["batch"][name]}
        del methods
    world = td.init()  # the world this ran in (idempotent)
    gloo = config["gloo_group"]
    ddp_backend = dist.get_backend(gloo) if gloo is not None else (
        dist.get_backend() if dist.is_initialized() else None)
    return {"backend": world.backend, "ddp_backend": ddp_backend, "models": out} if td.rank() == 0 else None


def _paired(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def summarize(raw: dict, world: int) -> dict:
    summary = {}
    for name, measured in raw.items():
        per_rep, cpu_per_rep = measured["wall"], measured["cpu"]
        batch = measured["batch"]
        global_batch = batch * world
        median = {label: statistics.median(v) for label, v in per_rep.items()}
        cpu = {label: statistics.median(v) for label, v in cpu_per_rep.items()}
        entry = {
            "per_rank_batch": batch,
            "step_s": median,
            "step_s_per_rep": per_rep,
            "cpu_s": cpu,
            "cpu_s_per_rep": cpu_per_rep,
            "samples_per_s": {
                label: (batch if label == "single" else global_batch) / s for label, s in median.items()
            },
            # Paired within each repetition (the methods alternated step by step there), then
            # the median over repetitions: load that drifts between repetitions cancels out.
            "efficiency": {
                label: _paired(per_rep["single"], v) for label, v in per_rep.items() if label != "single"
            },
        }
        if "ddp" in median:
            entry["ratio_per_rep"] = [d / t for d, t in zip(per_rep["ddp"], per_rep["tandem"], strict=True)]
            entry["ratio_tandem_over_ddp"] = statistics.median(entry["ratio_per_rep"])
            entry["ratio_of_medians"] = median["ddp"] / median["tandem"]
            entry["cpu_ratio_tandem_over_ddp"] = _paired(cpu_per_rep["ddp"], cpu_per_rep["tandem"])
        if "ddp_tandem" in median:  # DDP over tandem's MPI backend against DDP over Gloo
            entry["ratio_ddp_tandem_over_ddp"] = _paired(per_rep["ddp"], per_rep["ddp_tandem"])
        summary[name] = entry
    return summary


def print_table(summary: dict, world: int) -> None:
    print(f"\n{'model':8} {'method':10} {'step ms':>9} {'samples/s':>10} {'weak eff.':>9} {'CPU ms':>8}"
          "  per-rep step ms")
    for name, entry in summary.items():
        for label, seconds in entry["step_s"].items():
            eff = entry["efficiency"].get(label)
            reps = " ".join(f"{1e3 * s:.1f}" for s in entry["step_s_per_rep"][label])
            print(f"{name:8} {label:10} {1e3 * seconds:9.1f} {entry['samples_per_s'][label]:10.1f} "
                  f"{'' if eff is None else f'{eff:.2f}':>9} {1e3 * entry['cpu_s'][label]:8.1f}  {reps}")
        if "ratio_tandem_over_ddp" in entry:
            per = " ".join(f"{r:.3f}" for r in entry["ratio_per_rep"])
            print(f"{name:8} tandem/DDP throughput ratio: {entry['ratio_tandem_over_ddp']:.3f} "
                  f"(per rep: {per}); CPU-time ratio {entry['cpu_ratio_tandem_over_ddp']:.3f}")
        if "ratio_ddp_tandem_over_ddp" in entry:
            print(f"{name:8} DDP on backend tandem (MPI) / DDP on Gloo throughput ratio: "
                  f"{entry['ratio_ddp_tandem_over_ddp']:.3f}")
    print(f"(world size {world}; ratios > 1 mean tandem is faster / does less work; "
          "ddp_tandem: torch DDP over backend tandem (MPI))")


def parse_batch(text: str, models: list[str]) -> dict[str, int]:
    """`--batch`: "" (the defaults), "N" (every model), or "resnet9=256,gpt=8"."""
    batch = {name: BATCH[name] for name in models}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, number = part.rpartition("=")
        if name and name not in batch:
            raise ValueError(f"--batch {text!r}: {name!r} is not among --models {models}")
        if not number.isdigit() or int(number) < 1:
            raise ValueError(f"--batch {text!r}: {number!r} is not a positive batch size")
        batch.update({name: int(number)} if name else dict.fromkeys(batch, int(number)))
    return batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet9,mlp", help="comma-separated: resnet9, mlp, gpt")
    parser.add_argument("-np", "--nprocs", type=int, default=2,
                        help="ranks to spawn (without a launcher); 1: a world of one in this process")
    parser.add_argument("--backend", default=None,
                        help="tandem's backend (default: the launcher's, else NCCL with CUDA, else "
                             "Gloo); DDP runs on the same, or on Gloo beside MPI")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where models and data live")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast")
    parser.add_argument("--batch", default="", metavar="N|MODEL=N,...",
                        help=f"per-rank batch, for every model or per model (default {BATCH})")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (blocks per method)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per method first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--first-bucket-mb", type=float, default=1.0)
    parser.add_argument("--ddp-views", action="store_true", help="also DDP(gradient_as_bucket_view=True)")
    parser.add_argument("--out", default="results/dp_vs_ddp.json")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in BATCH]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: choose from {sorted(BATCH)}")
    try:
        batch = parse_batch(args.batch, models)
    except ValueError as error:
        parser.error(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA GPU is visible (torch {torch.__version__}, "
                     f"built for CUDA {torch.version.cuda})")
    config = {"models": models, "steps": args.steps, "reps": args.reps, "warmup": args.warmup,
              "threads": args.threads, "bucket_mb": args.bucket_mb,
              "first_bucket_mb": args.first_bucket_mb, "ddp_views": args.ddp_views,
              "device": args.device, "dtype": args.dtype, "batch": batch}
    load_before = os.getloadavg()
    if environments.detect().size > 1:  # started by a launcher: this process is one rank
        td.init(backend=args.backend)
        raw, world = worker(config), td.size()
        if td.rank() != 0:
            return 0
    elif args.nprocs == 1:  # a world of one needs no child process
        td.init(backend=args.backend)
        try:
            raw, world = worker(config), 1
        finally:
            td.shutdown()
    else:
        if args.backend == "mpi":
            parser.error("the MPI backend needs its ranks started by MPI: "
                         "tandem run -np 2 --backend mpi benchmarks/dp_vs_ddp.py")
        raw, world = td.spawn(worker, args.nprocs, args=(config,), backend=args.backend)[0], args.nprocs
    summary = summarize(raw["models"], world)
    print_table(summary, world)
    load_after = os.getloadavg()
    print(f"load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} cores")
    result = {"benchmark": "dp_vs_ddp", "world_size": world,
              "backend": raw["backend"], "ddp_backend": raw["ddp_backend"], "config": config,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": load_after, "models": summary}
    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
