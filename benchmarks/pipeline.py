"""Pipeline parallelism on 2 ranks: bubble and step time against theory, activation memory,
GPipe against 1F1B, and tandem against PyTorch's own `torch.distributed.pipelining`.

    python benchmarks/pipeline.py [--width 512] [--layers 16] [--batch 1024]
                                  [--chunks 1,2,4,8] [--repeats 7] [--out results/pipeline.json]

The model is an MLP of `--layers` Linear(width, width)+ReLU blocks split evenly over 2 stages:
compute (width² per row per layer) dominates the messages (width per row per micro-batch).
Every process runs one thread, so the 2 ranks do not fight over 2 cores.

- The per-stage compute time T of one full batch (forward + backward) is measured in the
  same processes: each rank runs its own stage's layers alone on the whole batch. Theory for
  p stages and m micro-batches: step time (m + p - 1) / m × T (T of the slower stage), bubble
  (idle share of a stage) (p - 1) / (m + p - 1).
- Measured bubble: 1 - compute time / step time on each stage (`pipe.stats`), mean of the stages.
- Step time: the slower rank's wall time of one step, after a barrier. The configurations run
  in interleaved rounds (one step of each per round) so that load from other jobs on a shared
  machine spreads over all of them; the table shows medians over rounds, and `ratio(min)`
  compares the fastest runs.
- compute/T: the time a stage spent in forward+backward during the step over T; above 1 when
  small micro-batches compute less efficiently than the whole batch (the theory assumes not).
- Round trip: one activation of an m=8 micro-batch there and back, measured in the same
  rounds; on a loaded machine its median (waking a descheduled process) dwarfs its minimum.
- Peak activation memory per stage: bytes autograd held saved for backward at once.
- torch: the same stages under `torch.distributed.pipelining` (ScheduleGPipe / Schedule1F1B)
  in the same processes; `torch/tandem` is its step time over tandem's (> 1: tandem faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

import tandem as td
from tandem.bench.results import write_json
from tandem.parallel.pipeline.schedules import bubble_fraction

STAGES = 2


def build_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def batch(rows: int, width: int):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)


def _timed_round(steps: dict, record: dict) -> None:
    """Run each step once, in turn, after a barrier; record this rank's wall time of each.

    Rounds interleave the configurations, so a busy spell on the shared machine hits them all
    alike instead of spoiling whichever happened to run then.
    """
    for name, step in steps.items():
        td.barrier()
        start = time.perf_counter()
        step()
        record.setdefault(name, []).append(time.perf_counter() - start)


def _stage_reference(part: nn.Module, x, rank: int, single: nn.Module):
    """This rank's stage alone on the full batch, and (rank 0) the whole model alone."""
    with torch.no_grad():
        stage_input = x if rank == 0 else single[: len(single) // STAGES](x)

    def stage_step():
        inp = stage_input.detach().requires_grad_(True)
        out = part(inp)
        out.backward(torch.ones_like(out))
        for p in part.parameters():
            p.grad = None

    def single_step():
        if rank == 0:
            out = single(x)
            out.backward(torch.ones_like(out))
            for p in single.parameters():
                p.grad = None

    return stage_step, single_step


def _ping_pong(args):
    """One round trip of a micro-batch activation (m = 8) between the two ranks, over the
    backend the pipeline uses: the cost of a message, under the same machine load."""
    backend = td.runtime.get_backend()
    tensor = torch.zeros(max(args.batch // 8, 1), args.width)
    peer = 1 - td.rank()

    def step():
        if td.rank() == 0:
            backend.send(tensor, peer, 7, None).wait()
            backend.recv(tensor, peer, 7, None).wait()
        else:
            backend.recv(tensor, peer, 7, None).wait()
            backend.send(tensor, peer, 7, None).wait()

    return step


def _tandem_step(args, schedule: str, chunks: int, x, y, stats: list):
    pipe = td.Pipeline(build_model(args.width, args.layers), chunks=chunks, schedule=schedule)

    def step():
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x, y, nn.functional.mse_loss)
        s = pipe.stats
        stats.append((s.idle_fraction, s.peak_activation_bytes, s.peak_live_microbatches, s.compute_s))

    return step


def _torch_step(args, schedule: str, chunks: int, x, y):
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    except ImportError:
        return None
    model = build_model(args.width, args.layers)
    per_stage = len(model) // STAGES
    rank = td.rank()
    part = model[rank * per_stage : (rank + 1) * per_stage]
    stage = PipelineStage(part, rank, STAGES, device=torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    try:
        runner = kind(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)
    except ValueError:  # torch's 1F1B needs at least as many micro-batches as stages
        return None

    def step():
        for p in part.parameters():
            p.grad = None
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=[])

    return step


def ranks_main(args) -> dict:
    torch.set_num_threads(1)
    x, y = batch(args.batch, args.width)
    rank = td.rank()
    model = build_model(args.width, args.layers)
    per_stage = len(model) // STAGES
    stage_step, single_step = _stage_reference(
        model[rank * per_stage : (rank + 1) * per_stage], x, rank, model
    )
    steps = {"stage": stage_step, "single": single_step, "ping": _ping_pong(args)}
    stats: dict[tuple, list] = {}
    for schedule in ("gpipe", "1f1b"):
        for chunks in args.chunks:
            stats[(schedule, chunks)] = []
            steps[("tandem", schedule, chunks)] = _tandem_step(
                args, schedule, chunks, x, y, stats[(schedule, chunks)])
            torch_step = _torch_step(args, schedule, chunks, x, y)
            if torch_step is not None:
                steps[("torch", schedule, chunks)] = torch_step
    warmup: dict = {}
    for _ in range(2):
        _timed_round(steps, warmup)
    times: dict = {}
    for _ in range(args.repeats):
        _timed_round(steps, times)
    everyone = td.allgather_object(times)
    slowest = {k: [max(r[k][i] for r in everyone) for i in range(args.repeats)] for k in times}
    mine = {k: (statistics.median(t[0] for t in v[2:]), v[-1][1], v[-1][2],
                statistics.median(t[3] for t in v[2:])) for k, v in stats.items()}
    per_stage_stats = td.allgather_object(mine)
    per_stage_time = td.allgather_object(times["stage"])
    return {"slowest": slowest, "stats": per_stage_stats, "stage_times": per_stage_time}


def summarize(result: dict, args) -> tuple[list[dict], dict]:
    slowest, stats = result["slowest"], result["stats"]
    reference = {
        "stage_s": [statistics.median(t) for t in result["stage_times"]],
        "stage_max_s": statistics.median(slowest["stage"]),
        "stage_max_min_s": min(slowest["stage"]),
        "single_s": statistics.median(slowest["single"]),
        "round_trip_s": statistics.median(slowest["ping"]),
        "round_trip_min_s": min(slowest["ping"]),
    }
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.chunks:
            ours = slowest[("tandem", schedule, m)]
            theirs = slowest.get(("torch", schedule, m))
            factor = (m + STAGES - 1) / m
            rows.append({
                "schedule": schedule,
                "chunks": m,
                "step_s": statistics.median(ours),
                "step_min_s": min(ours),
                "step_s_all": ours,
                "theory_step_s": factor * reference["stage_max_s"],
                "theory_step_min_s": factor * reference["stage_max_min_s"],
                "bubble_per_stage": [s[(schedule, m)][0] for s in stats],
                "bubble": statistics.mean(s[(schedule, m)][0] for s in stats),
                "theory_bubble": bubble_fraction(STAGES, m),
                "peak_activation_bytes": [s[(schedule, m)][1] for s in stats],
                "peak_live_microbatches": [s[(schedule, m)][2] for s in stats],
                "compute_s_per_stage": [s[(schedule, m)][3] for s in stats],
                "torch_step_s": statistics.median(theirs) if theirs else None,
            })
    return rows, reference


def _table(rows: list[dict], reference: dict) -> str:
    head = (f"{'schedule':<8} {'m':>2} {'step ms':>8} {'theory':>7} {'ratio':>6} {'ratio(min)':>10} "
            f"{'bubble':>7} {'theory':>7} {'compute/T':>9} {'speedup':>7} {'torch ms':>8} "
            f"{'torch/tandem':>12} "
            f"{'act MiB s0/s1':>14} {'live s0/s1':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        torch_ms = f"{r['torch_step_s'] * 1e3:8.1f}" if r["torch_step_s"] else f"{'n/a':>8}"
        ratio = f"{r['torch_step_s'] / r['step_s']:12.2f}" if r["torch_step_s"] else f"{'n/a':>12}"
        mib = "/".join(f"{b / 2**20:.1f}" for b in r["peak_activation_bytes"])
        live = "/".join(str(n) for n in r["peak_live_microbatches"])
        lines.append(
            f"{r['schedule']:<8} {r['chunks']:>2} {r['step_s'] * 1e3:8.1f} "
            f"{r['theory_step_s'] * 1e3:7.1f} {r['step_s'] / r['theory_step_s']:6.2f} "
            f"{r['step_min_s'] / r['theory_step_min_s']:10.2f} {r['bubble']:7.1%} "
            f"{r['theory_bubble']:7.1%} {max(r['compute_s_per_stage']) / reference['stage_max_s']:9.2f} "
            f"{reference['single_s'] / r['step_s']:7.2f} {torch_ms} "
            f"{ratio} {mib:>14} {live:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16, help="Linear+ReLU blocks (even)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="results/pipeline.json")
    args = parser.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",")]

    load_before = os.getloadavg()
    rows, reference = summarize(td.spawn(ranks_main, STAGES, args=(args,))[0], args)
    load_after = os.getloadavg()

    print(f"MLP {args.layers}×Linear({args.width},{args.width})+ReLU, batch {args.batch}, "
          f"{STAGES} stages, 1 thread per process. Per-stage compute of the full batch, one "
          f"process each: {', '.join(f'{t * 1e3:.1f} ms' for t in reference['stage_s'])}; "
          f"whole model in one process: {reference['single_s'] * 1e3:.1f} ms. Round trip of one "
          f"m=8 activation: median {reference['round_trip_s'] * 1e3:.2f} ms, fastest "
          f"{reference['round_trip_min_s'] * 1e3:.2f} ms")
    print(_table(rows, reference))
    print(f"theory = (m+p-1)/m × per-stage time (the slower stage); ratio = measured / theory "
          f"(medians; ratio(min): fastest runs); bubble = idle share of a stage, measured by "
          f"tandem's counters; compute/T = a stage's forward+backward time within the step over T (>1: "
          f"micro-batches compute less efficiently than the whole batch); speedup = one process / "
          f"pipeline. {args.repeats} interleaved "
          f"rounds; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(machine shared with other jobs).")
    result = {
        "benchmark": "pipeline",
        "config": {"width": args.width, "layers": args.layers, "batch": args.batch,
                   "stages": STAGES, "repeats": args.repeats, "threads_per_rank": 1},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "reference": reference,
        "rows": rows,
    }
    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
