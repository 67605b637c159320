"""What `tandem.horovod`'s Horovod semantics cost per call: hvd vs td vs torch.distributed.

    python benchmarks/horovod_ops.py [--np 2] [--iters 200] [--out results/horovod_ops.json]
    tandem run -np 2 --backend mpi benchmarks/horovod_ops.py --backend mpi \
        --out results/horovod_ops_mpi.json          # on MPI: mpi4py's Allreduce is the anchor

Every `hvd` operation on the global set runs one negotiation first, tandem's fixed-size
agreement (how a joined rank learns what to answer, and how a mismatch becomes Horovod's
RuntimeError), then hands the data to the engine: two messages, as `td.allreduce` with its
argument check. This measures the time per blocking allreduce, at a few sizes, of
`hvd.allreduce`, `td.allreduce` (checks on) and plain `torch.distributed.all_reduce` (the
PyTorch equivalent, on the same Gloo process group, no check), interleaved in one run on `np`
local ranks, and prints the ratios. It is a latency claim, so it lives here and not in the
unit tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import tandem as td

SIZES = (1, 1024, 262144)  # float32 elements: 4 B, 4 KB, 1 MB


def _time(call, tensor, iters: int) -> float:
    for _ in range(5):
        call(tensor)
    td.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call(tensor)
    return (time.perf_counter() - start) / iters


def _messages(call, tensor) -> int:
    """Operations one call hands the engine (the watchdog counts every one of tandem's)."""
    from tandem import runtime

    issued = runtime.get_backend().watchdog._issued
    before = sum(issued.values())
    call(tensor)
    return sum(issued.values()) - before


def _anchor(backend: str):
    """The raw engine call, out of place as hvd.allreduce is: (its name, the call)."""
    if backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        return "mpi4py", lambda t: comm.Allreduce(MPI.IN_PLACE, t.clone().numpy(), op=MPI.SUM)
    import torch.distributed as dist

    return "torch.distributed", lambda t: dist.all_reduce(t.clone())


def measure(iters: int, rounds: int, backend: str = "gloo") -> dict:
    import tandem.horovod as hvd

    hvd.init()
    calls = dict([_anchor(backend)])
    calls.update({
        "td.allreduce": lambda t: td.allreduce(t, op="sum"),
        "hvd.allreduce": lambda t: hvd.allreduce(t, op=hvd.Sum),
    })
    rows = {}
    for numel in SIZES:
        tensor = torch.ones(numel)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):  # interleaved, so a load that drifts hits all three alike
            for name, call in calls.items():
                samples[name].append(_time(call, tensor, iters))
        rows[numel] = {name: statistics.median(values) for name, values in samples.items()}
        rows[numel]["messages"] = {name: _messages(calls[name], tensor)
                                   for name in ("td.allreduce", "hvd.allreduce")}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                        help="mpi: run under `tandem run --backend mpi` (--np is then -np's)")
    parser.add_argument("--out", default="results/horovod_ops.json")
    args = parser.parse_args()
    if args.backend == "mpi":
        td.init(backend="mpi")
        rows = measure(args.iters, args.rounds, "mpi")
        args.np = td.size()
        if td.rank() != 0:
            td.shutdown()
            return 0
    else:
        rows = td.spawn(measure, args.np, args=(args.iters, args.rounds), backend="gloo")[0]
    anchor = "mpi4py" if args.backend == "mpi" else "torch.distributed"
    short = "mpi4py" if args.backend == "mpi" else "torch"
    print(f"{args.np} ranks on {args.backend}, blocking allreduce (sum), median of {args.rounds} "
          f"x {args.iters} calls; messages per call: {short} 1, td and hvd as counted")
    print(f"{'elements':>10}{short + ' (us)':>12}{'td (us)':>10}{'hvd (us)':>10}"
          f"{'td/' + short:>11}{'hvd/' + short:>11}{'hvd/td':>8}{'td msgs':>9}{'hvd msgs':>9}")
    for numel, row in rows.items():
        base, mine, front = row[anchor], row["td.allreduce"], row["hvd.allreduce"]
        counted = row["messages"]
        print(f"{numel:>10}{base * 1e6:>12.1f}{mine * 1e6:>10.1f}{front * 1e6:>10.1f}"
              f"{mine / base:>11.2f}{front / base:>11.2f}{front / mine:>8.2f}"
              f"{counted['td.allreduce']:>9}{counted['hvd.allreduce']:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"np": args.np, "backend": args.backend, "anchor": anchor,
                               "iters": args.iters, "rounds": args.rounds,
                               "seconds_per_call": rows},
                              indent=1))
    print(f"wrote {out}")
    if args.backend == "mpi":
        td.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
