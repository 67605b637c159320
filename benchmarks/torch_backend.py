"""torch.distributed on backend "tandem" (the MPI engine): its cost per collective against mpi4py.

    tandem run -np 2 benchmarks/torch_backend.py [--budget 1] [--max-size 64MB] [--out FILE]

Under `tandem run` (MPI is the CPU default) `td.init()` makes torch's default group tandem's,
so `dist.all_reduce(t)` goes through the Python process group (`comm/torch_pg/process_group.py`), the
watchdog and the MPI engine: what an unchanged script gets from `init_process_group("tandem")`
(or "mpi"). For each float32 message size, in place, three collectives are timed with the loop
of `tandem.bench.allreduce_ranks.measure` (variants take turns batch after batch, median over
batches of rank 0's time per call):

- all_reduce: mpi4py's blocking `Allreduce(IN_PLACE)` on the same memory ("raw"), torch's
  `dist.all_reduce(t)` on backend tandem with checks off ("backend") and on, the default
  ("+check": the argument check's small message first), and tandem's own
  `td.allreduce(t, inplace=True)` with checks off (for reference);
- broadcast: mpi4py `Bcast` against `dist.broadcast(t, 0)`;
- all_gather: mpi4py `Allgather` against `dist.all_gather_into_tensor(out, t)` (its new name,
  `all_gather_single`, where torch has it).

The ratio raw time / backend time is what the Python backend costs (1.0: nothing). The table
is printed and the times go to JSON (`results/torch_backend.json`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.distributed as dist

import tandem as td
from tandem import runtime
from tandem.bench.allreduce_ranks import measure
from tandem.bench.results import write_json

# torch 2.13 renamed all_gather_into_tensor (which now warns on every call): the new name where
# there is one, so the table shows the backend's cost, not the deprecation warning's.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20}


def variants(comm, MPI, size: int) -> dict:
    """name -> (setup, call(buffer)) for every collective, raw and through the backend."""
    outputs: dict[int, tuple[torch.Tensor, object, object]] = {}

    def views(buffer: torch.Tensor):
        found = outputs.get(id(buffer))
        if found is None:
            outputs.clear()
            out = torch.empty(size * buffer.numel())
            found = outputs[id(buffer)] = (out, buffer.numpy(), out.numpy())
        return found

    def nothing() -> None:
        return None

    def checks_off() -> None:
        runtime.state().checks = False

    def checks_on() -> None:
        runtime.state().checks = True

    return {
        "allreduce_raw": (nothing, lambda b: comm.Allreduce(MPI.IN_PLACE, views(b)[1], op=MPI.SUM)),
        "allreduce_backend": (checks_off, lambda b: dist.all_reduce(b)),
        "allreduce_checked": (checks_on, lambda b: dist.all_reduce(b)),
        "allreduce_td": (checks_off, lambda b: td.allreduce(b, op="sum", inplace=True)),
        "broadcast_raw": (nothing, lambda b: comm.Bcast(views(b)[1], root=0)),
        "broadcast_backend": (checks_off, lambda b: dist.broadcast(b, 0)),
        "allgather_raw": (nothing, lambda b: comm.Allgather(views(b)[1], views(b)[2])),
        "allgather_backend": (checks_off, lambda b: ALL_GATHER(views(b)[0], b)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per size, about")
    parser.add_argument("--max-size", default="64MB", choices=list(SIZES))
    parser.add_argument("--out", default="results/torch_backend.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = td.init()
    if world.backend != "mpi" or dist.get_backend() != "tandem":
        parser.error("run it under MPI: tandem run -np 2 benchmarks/torch_backend.py "
                     f"(here: tandem on {world.backend}, torch's group {dist.get_backend()})")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    names = list(SIZES)[: list(SIZES).index(args.max_size) + 1]
    sizes = [SIZES[n] for n in names]
    try:
        times = measure(variants(comm, MPI, world.size), comm.Barrier,
                        lambda v: comm.bcast(v, root=0), sizes, args.budget, torch.device("cpu"))
    finally:
        comm.Free()
    if world.rank == 0:
        print(f"\n{'size':>6} {'collective':>10} {'mpi4py':>10} {'backend':>10} {'raw/backend':>11}"
              f" {'+check':>10} {'raw/+check':>10} {'td.allreduce':>12}")
        for i, name in enumerate(names):
            for op in ("allreduce", "broadcast", "allgather"):
                raw, mine = times[f"{op}_raw"][i], times[f"{op}_backend"][i]
                extra = ""
                if op == "allreduce":
                    checked = times["allreduce_checked"][i]
                    extra = (f"{1e6 * checked:8.1f}us {raw / checked:10.2f} "
                             f"{1e6 * times['allreduce_td'][i]:10.1f}us")
                print(f"{name:>6} {op:>10} {1e6 * raw:8.1f}us {1e6 * mine:8.1f}us {raw / mine:11.2f}"
                      f" {extra}")
        load = os.getloadavg()[0]
        print(f"(world size {world.size}, MPI engine; load average {load:.1f} on "
              f"{os.cpu_count()} cores)")
        result = {"benchmark": "torch_backend", "world_size": world.size, "sizes": names,
                  "seconds_per_call": times, "torch": torch.__version__,
                  "python": platform.python_version(), "cpus": os.cpu_count(),
                  "load_average": os.getloadavg()}
        print(f"wrote {write_json(result, args.out)}")
    td.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
