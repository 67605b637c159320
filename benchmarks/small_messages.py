"""Small all-reduces: tandem's call against the raw engine call, in the same job.

    tandem run -np 2 --backend mpi benchmarks/small_messages.py     # results/small_messages.json
    tandem run -np 2 --backend gloo benchmarks/small_messages.py --backend gloo \
        --out results/small_messages_gloo.json
    tandem run -np 2 --backend mpi benchmarks/small_messages.py --sizes 4K,64K --batches 60
    tandem run -np 2 --backend mpi benchmarks/small_messages.py --op broadcast   # or allgather

Each rank times, for float32 messages of 4 KB (1K elements) to 1 MB (256K elements), in
batches of back-to-back calls after a barrier, taking turns batch after batch:

* the anchor: on MPI, mpi4py's `comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)` on a NumPy
  view; on Gloo, `torch.distributed.all_reduce(t)` on torch's default group (tandem's);
* engine: tandem's engine call (`get_backend().allreduce_now`), what its hot paths make;
* td, checks off: `td.allreduce(t, op="sum", inplace=True)` with `checks=False`;
* td, checks on: the same call with the argument check (the default): one fixed-size
  agreement message before the data.

A batch's time is the slowest rank's. Printed per variant: the best batch (what the call
costs when the machine lets it run: robust on a shared machine, where other processes take
the cores) and the median batch, and each one's ratio to the anchor's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tandem as td
from tandem import runtime
from tandem.bench.results import write_json

UNITS = {"K": 1 << 10, "M": 1 << 20}


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def _calls(op: str, backend: str, engine, state, buffer: torch.Tensor, array):
    """(the raw engine call, tandem's engine call, td's call) of `op` on `buffer`."""
    def wait(work) -> None:
        if work is not None:
            work.wait(state.timeout)

    if op == "allreduce":
        if backend == "mpi":
            from mpi4py import MPI

            def anchor():
                MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        else:
            import torch.distributed as dist

            def anchor():
                dist.all_reduce(buffer)
        return (anchor, lambda: wait(engine.allreduce_now(buffer, "sum", None)),
                lambda: td.allreduce(buffer, op="sum", inplace=True))
    if op == "broadcast":
        if backend == "mpi":
            from mpi4py import MPI

            def anchor():
                MPI.COMM_WORLD.Bcast(array, root=0)
        else:
            import torch.distributed as dist

            def anchor():
                dist.broadcast(buffer, 0)
        return (anchor, lambda: wait(engine.broadcast_now(buffer, 0, None)),
                lambda: td.broadcast(buffer, root=0))
    # allgather: a new output per call, as td.allgather returns one
    size = td.size()
    if backend == "mpi":
        from mpi4py import MPI

        def anchor():
            out = torch.empty(size * buffer.numel())
            MPI.COMM_WORLD.Allgather(array, out.numpy())
    else:
        import torch.distributed as dist

        def anchor():
            dist.all_gather_into_tensor(torch.empty(size * buffer.numel()), buffer)
    return (anchor,
            lambda: engine.allgather_into(torch.empty(size * buffer.numel()), buffer,
                                          None).wait(state.timeout),
            lambda: td.allgather(buffer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4K,16K,64K,1M")
    parser.add_argument("--backend", choices=("mpi", "gloo"), default="mpi")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--calls", type=int, default=100, help="calls per batch")
    parser.add_argument("--op", choices=("allreduce", "broadcast", "allgather"),
                        default="allreduce", help="the collective timed (default allreduce)")
    parser.add_argument("--out", default="results/small_messages.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    td.init(backend=args.backend)
    if args.backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        anchor_name = "mpi4py"
        barrier = comm.Barrier

        def slowest(seconds: float) -> float:
            return comm.allreduce(seconds, op=MPI.MAX)
    else:
        import torch.distributed as dist

        anchor_name = "torch.dist"
        barrier = dist.barrier

        def slowest(seconds: float) -> float:
            value = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            return float(value)
    engine = runtime.get_backend()
    state = runtime.state()
    results = {}
    for nbytes in map(_size, args.sizes.split(",")):
        buffer = torch.zeros(nbytes // 4)  # zeros: repeated in-place sums stay finite
        array = buffer.numpy()

        anchor, now, ours = _calls(args.op, args.backend, engine, state, buffer, array)
        variants = {
            anchor_name: (None, anchor),
            "engine": (None, now),
            "td": (False, ours),
            "td+checks": (True, ours),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.batches):
            for name, (checks, call) in variants.items():
                if checks is not None:
                    state.checks = checks
                for _ in range(3):
                    call()
                barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                seconds = (time.perf_counter() - start) / args.calls
                samples[name].append(slowest(seconds))
        state.checks = True
        results[nbytes] = {name: {"best": min(s), "median": statistics.median(s)}
                           for name, s in samples.items()}
    if td.rank() == 0:
        what = {"allreduce": "all-reduce (sum, in place)", "broadcast": "broadcast from rank 0",
                "allgather": "all-gather (equal first dims)"}[args.op]
        print(f"float32 {what}, {td.size()} ranks on {args.backend}; per "
              f"call, slowest rank, {args.batches} batches of {args.calls} calls; ratio = time / "
              f"{anchor_name}'s")
        print(f"{'size':>6}  {'variant':<10}{'best us':>9}{'ratio':>7}{'median us':>11}{'ratio':>7}")
        for nbytes, row in results.items():
            anchor = row[anchor_name]
            for name, timing in row.items():
                print(f"{nbytes // 1024:>4} K  {name:<10}{timing['best'] * 1e6:>9.1f}"
                      f"{timing['best'] / anchor['best']:>7.2f}{timing['median'] * 1e6:>11.1f}"
                      f"{timing['median'] / anchor['median']:>7.2f}")
        write_json({"config": vars(args), "ranks": td.size(), "anchor": anchor_name, "op": args.op,
                    "seconds_per_call": results},
                   args.out)
    td.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
