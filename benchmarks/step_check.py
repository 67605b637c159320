"""The price of the split models' step check: one agreement per forward, backward, pipeline step.

    python benchmarks/step_check.py                          # MPI and Gloo, 2 ranks, CPU
    python benchmarks/step_check.py --backends gloo --steps 200

Each backend runs one 2-rank job (`tandem run`) that trains three small models, one step at a
time in turn, in three variants: `after`, with their agreements (the default); `before`, the
agreements hidden (what a step did before them: the model's own collectives, tensor-parallel
layers' per-call argument checks included); `bare`, argument checks off altogether
(`TANDEM_CHECKS=0`: no agreement at all, what dropping the per-call checks would approach):

- `fully_shard`: 4 blocks Linear(256, 256)+ReLU and a head, each block a unit and the root,
  SGD, per-rank batch 32 (2 agreements a step: the forward, the backward);
- `tensor-parallel`: Linear(256, 1024) colwise then Linear(1024, 256) rowwise, batch 32
  (2 agreements a step);
- `pipeline`: 4 Linear(256, 256)+ReLU over 2 stages, 4 micro-batches of 8 (1 agreement a step).

The variants alternate step by step, so a busy machine slows them alike; the table gives the
median step time of each and the ratio after/before. JSON goes to `results/step_check.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(out: str, steps: int, warmup: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import tandem as td
    from tandem import runtime
    from tandem.parallel import model_check
    from tandem.parallel.fully_shard.unit import unit_of

    td.init()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(td.rank())
    x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)

    sharded = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)],
                            nn.Linear(256, 256))
    for block in list(sharded)[:4]:
        td.fully_shard(block)
    td.fully_shard(sharded)
    root = unit_of(sharded)
    shard_opt = torch.optim.SGD(sharded.parameters(), lr=1e-3)

    parallel = td.parallelize(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)),
                              {"0": "colwise", "2": "rowwise"})
    tp_opt = torch.optim.SGD(parallel.parameters(), lr=1e-3)
    tp_check = model_check.check_of(parallel)
    same = torch.randn(32, 256, generator=torch.Generator().manual_seed(7))  # tp: one batch

    pipe = td.Pipeline(nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())]),
                       chunks=4)
    pipe_opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    pipe_check = pipe._check

    def shard_step():
        shard_opt.zero_grad()
        F.mse_loss(sharded(x), y).backward()
        shard_opt.step()

    def tp_step():
        tp_opt.zero_grad()
        F.mse_loss(parallel(same), same).backward()
        tp_opt.step()

    def pipe_step():
        pipe.train_step(same, same, F.mse_loss)
        pipe_opt.step()
        pipe_opt.zero_grad()

    def shard_switch(on: bool):
        root.check = root_check if on else None

    def tp_switch(on: bool):
        model_check.register(parallel, tp_check if on else None)

    def pipe_switch(on: bool):
        pipe._check = pipe_check if on else None

    root_check, state = root.check, runtime.state()
    loads = {"fully_shard": (shard_step, shard_switch), "tensor-parallel": (tp_step, tp_switch),
             "pipeline": (pipe_step, pipe_switch)}
    variants = ("bare", "before", "after")
    times = {(load, v): [] for load in loads for v in variants}
    for i in range(warmup + steps):
        order = variants[i % 3:] + variants[: i % 3]  # rotated: no variant always first
        for load, (step, switch) in loads.items():
            for variant in order:
                switch(variant == "after")
                td.barrier()
                state.checks = variant != "bare"
                start = time.perf_counter()
                step()
                elapsed = time.perf_counter() - start
                state.checks = True
                if i >= warmup:
                    times[(load, variant)].append(elapsed)
            switch(True)
    if td.rank() == 0:
        Path(out).write_text(json.dumps({f"{load} | {v}": statistics.median(t) * 1e6
                                         for (load, v), t in times.items()}))
    td.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="mpi,gloo")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default="results/step_check.json")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.warmup)
        return 0
    from tandem.bench.faults import job_environment
    from tandem.bench.results import write_json

    results = {}
    rows = [f"{'backend':<8}{'model':<18}{'bare µs':>9}{'before µs':>11}{'after µs':>10}"
            f"{'after/before':>14}"]
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        scratch = Path(args.out).with_suffix(f".{backend}.tmp.json")
        scratch.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", backend,
                   __file__, "--worker", str(scratch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
        done = subprocess.run(command, cwd=ROOT, env=job_environment({}), capture_output=True,
                              text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"the {backend} job failed:\n{done.stderr[-3000:]}")
        measured = json.loads(scratch.read_text())
        scratch.unlink()
        results[backend] = measured
        for load in ("fully_shard", "tensor-parallel", "pipeline"):
            bare, before, after = (measured[f"{load} | {v}"] for v in ("bare", "before", "after"))
            rows.append(f"{backend:<8}{load:<18}{bare:>9.0f}{before:>11.0f}{after:>10.0f}"
                        f"{after / before:>14.3f}")
    print("\n".join(rows))
    write_json(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
