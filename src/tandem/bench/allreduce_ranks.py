"""What the ranks of the all-reduce benchmark run: one timing loop, one set of variants per engine.

`tandem.bench.allreduce` starts the ranks and reads their times; this module is their side.
Every engine gets the same loop (`measure`): for each message size, the variants take turns
batch after batch, each batch `k` back-to-back calls after a barrier; a variant's time is the
median over batches of rank 0's time per call. On a GPU the buffer lives there and each batch
ends with `torch.cuda.synchronize()`, so the time counts the work the calls queued, not only
their launch.

- Gloo (`gloo_worker`, started like `td.spawn`): raw `torch.distributed.all_reduce`, then
  tandem. With CUDA tensors raw Gloo takes them as they are; tandem's user-facing call stages
  them through the CPU (DESIGN §2) and its hot path hands them to Gloo as the reducer does.
- NCCL (`nccl_worker`): raw `all_reduce` on the NCCL group against tandem on NCCL, one rank per
  GPU (a GPU shared by two NCCL ranks is refused by NCCL itself).
- MPI (`mpi_worker`, under mpiexec): raw mpi4py on NumPy against tandem's MPI backend. With
  CUDA tensors the raw side copies through pinned host memory by hand, what a user of an MPI
  that is not CUDA-aware writes; tandem stages the same way, or hands the GPU buffer to a
  CUDA-aware MPI.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BATCH_S = 0.01  # one timed batch of back-to-back calls lasts about this long
MIN_BATCHES, MAX_BATCHES = 3, 25

Variants = dict[str, tuple[Callable[[], None], Callable[["torch.Tensor"], None]]]


def _device(name: str) -> torch.device:
    """The buffers' device: the CPU, or the GPU `td.init` gave this rank."""
    import torch

    import tandem as td

    return torch.device("cpu") if name == "cpu" else td.device()


def _synchronizer(device: torch.device) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return _nothing


def measure(
    variants: Variants,
    barrier: Callable[[], None],
    agree: Callable[[int], int],
    sizes: Sequence[int],
    budget_s: float,
    device: torch.device,
) -> dict[str, list[float]]:
    """Seconds per call for each variant and size; the same code runs on every rank.

    `variants` maps a name to (setup, call); `agree(v)` returns rank 0's `v` on every rank,
    so all ranks run the same number of calls.
    """
    import torch

    sync = _synchronizer(device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    first = next(iter(variants))
    for nbytes in sizes:
        # zeros: repeated in-place sums stay finite
        buffer = torch.zeros(nbytes // 4, device=device)
        for setup, call in variants.values():
            setup()
            for _ in range(3):
                call(buffer)
        sync()
        setup, call = variants[first]
        setup()
        barrier()
        start = time.perf_counter()
        call(buffer)
        sync()
        one = time.perf_counter() - start
        calls = agree(max(1, int(BATCH_S / max(one, 1e-7))))
        per_round = len(variants) * calls * max(one, 1e-7)
        batches = agree(max(MIN_BATCHES, min(MAX_BATCHES, int(budget_s / per_round))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(batches):
            for name, (setup, call) in variants.items():
                setup()
                barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call(buffer)
                sync()
                samples[name].append((time.perf_counter() - start) / calls)
        for name in variants:
            times[name].append(statistics.median(samples[name]))
    return times


def tandem_variants(prefix: str) -> Variants:
    """tandem's engine call (the reducer's hot path), and its user-facing call, checks off / on."""
    import tandem as td
    from tandem import runtime

    def checks(flag: bool) -> Callable[[], None]:
        def setup() -> None:
            runtime.state().checks = flag

        return setup

    def call(buffer: torch.Tensor) -> None:
        td.allreduce(buffer, op="sum", inplace=True)

    backend = runtime.get_backend()

    def hot(buffer: torch.Tensor) -> None:
        # What tandem's own hot paths (the gradient reducer) do: the engine, nothing else.
        backend.allreduce(buffer, "sum", None).wait()

    return {
        f"{prefix}_hot": (checks(False), hot),
        f"{prefix}_tandem": (checks(False), call),
        f"{prefix}_tandem_checks": (checks(True), call),
    }


def _nothing() -> None:
    return None


def torch_worker(prefix: str, sizes: Sequence[int], budget_s: float, device: str = "cpu") -> dict:
    """One Gloo or NCCL rank (run through `td.spawn`): raw torch.distributed, then tandem."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    where = _device(device)
    # NCCL moves CUDA tensors only: its barrier and agreements travel on the GPU too.
    small = where if prefix == "nccl" else torch.device("cpu")

    def agree(value: int) -> int:
        box = torch.tensor([value], device=small)
        dist.broadcast(box, 0)
        return int(box.item())

    variants: Variants = {f"{prefix}_raw": (_nothing, lambda buffer: dist.all_reduce(buffer))}
    variants.update(tandem_variants(prefix))
    return measure(variants, dist.barrier, agree, sizes, budget_s, where)


def mpi_worker(sizes: Sequence[int], budget_s: float, result: Path, device: str = "cpu") -> None:
    """One MPI rank (run under mpiexec): raw mpi4py on NumPy, then tandem's MPI backend.

    Rank 0 writes the times to `result` as JSON.
    """
    import torch

    import tandem as td

    torch.set_num_threads(1)
    td.init(backend="mpi")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    where = _device(device)
    hosts: dict[int, tuple[torch.Tensor, object]] = {}

    def raw(buffer: torch.Tensor) -> None:
        found = hosts.get(id(buffer))
        if found is None:
            hosts.clear()
            host = buffer if buffer.device.type == "cpu" else torch.empty(buffer.shape, pin_memory=True)
            found = hosts[id(buffer)] = (host, host.numpy())
        host, array = found
        if host is not buffer:
            host.copy_(buffer)  # blocking: the GPU's work on the buffer is done first
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        if host is not buffer:
            buffer.copy_(host)

    variants: Variants = {"mpi_raw": (_nothing, raw)}
    variants.update(tandem_variants("mpi"))
    try:
        times = measure(variants, comm.Barrier, lambda v: comm.bcast(v, root=0), sizes, budget_s, where)
        if td.rank() == 0:
            result.write_text(json.dumps(times))
    finally:
        td.shutdown()
