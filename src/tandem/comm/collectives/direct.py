"""Collectives of tandem's hot paths: straight to the engine, no check, nothing read on the host.

    with direct.covering(group):           # an agreement already covers this operation
        y = direct.allreduce(x, "sum", group)

Tensor-parallel layers, `td.tensor.Branches` and `td.functional` inside a tensor-parallel model call
these instead of the user-facing collectives. Their ranks agreed once on the layout (at
`td.parallelize` or `Branches` construction), and each forward and backward of the model opens
with one fixed-size agreement (`parallel/operation_check.py`) that names a rank in another
operation; so a collective inside needs no argument check of its own, and the sizes it needs
are known from the layout (equal shards, lengths cached by the caller) instead of exchanged.
Nothing here reads a tensor on the host: on NCCL each call only queues work on the GPU, as
DDP's and Megatron's do.

The one door from tandem's split-model code to the engine: fully_shard, ZeroOptimizer, the
pipeline's links, context parallelism's ring, SyncBatchNorm, LocalSGD and the data-parallel
wrappers' own messages start their operations here too, on their own buffers (`*_into`,
`send`, `recv`: the engine's work and the staged tensors come back), and call no engine
operation themselves (tests/test_one_door.py). What is not covered by an agreement goes
through the checked collectives (`user`); a data-parallel comm hook is handed the engine as
DDP's hooks are (`bucket.backend`).

`covering(group)` marks, for the operation that runs inside it (a model's forward), that an
agreement over `group` covers its collectives; `frame(group)` is the innermost such mark
(None: nothing covers a collective on `group` here, and the caller checks it alone). A mark
also remembers the tensors that entered a split region during that forward (`entered`), so
that one input read by several column-parallel layers (separate q, k and v projections)
enters once and its gradient is all-reduced once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from tandem.comm import context
from tandem.comm.collectives import user as collectives
from tandem.comm.collectives.user import Staging, divide
from tandem.comm.engines.backend import Group, Work, on_wire
from tandem.comm.members import group_size


class Frame:
    """One covered operation on one group: its group and what entered a region in it."""

    __slots__ = ("group", "entered")

    def __init__(self, group: Group | None) -> None:
        self.group = group
        self.entered: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}


_local = threading.local()


def _frames() -> list[Frame]:
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def _same(a: Group | None, b: Group | None) -> bool:
    return a is b or (a is not None and b is not None and a.ranks == b.ranks)


def frame(group: Group | None) -> Frame | None:
    """The innermost covered operation on `group`, or None."""
    for found in reversed(_frames()):
        if _same(found.group, group):
            return found
    return None


def enter(group: Group | None) -> Frame:
    """An operation covered by an agreement over `group` begins (a forward pre-hook)."""
    found = Frame(group)
    _frames().append(found)
    return found


def leave(found: Frame) -> None:
    """...and ends (a forward hook that runs also when the forward raised)."""
    frames = _frames()
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] is found:
            del frames[i]
            return


@contextmanager
def covering(group: Group | None) -> Iterator[Frame]:
    found = enter(group)
    try:
        yield found
    finally:
        leave(found)


# -- the engine calls --------------------------------------------------------------------------
# Each stages through `collectives.Staging`: the tensor itself where the engine takes it, else
# a copy on the device it does take (Gloo: the CPU; int16 carried as int32), copied back.


def _staged(tensor: torch.Tensor, engine) -> Staging:
    return Staging(tensor, engine)


def _empty(shape, like: torch.Tensor, engine) -> Staging:
    return Staging(torch.empty(shape, dtype=like.dtype, device=like.device), engine)


def allreduce(tensor: torch.Tensor, op: str, group: Group | None, *,
              inplace: bool = False) -> torch.Tensor:
    """The reduction over `group` (`op`: a native op or "mean"), as a new tensor unless `inplace`."""
    engine = context.current()
    staging = _staged(tensor if inplace else tensor.clone(memory_format=torch.contiguous_format),
                      engine)
    work = engine.backend.allreduce_now(staging.buffer, "sum" if op == "mean" else op, group)
    if work is not None:
        work.wait(engine.timeout)
    result = staging.copy_back()
    return divide(result, group_size(group)) if op == "mean" else result


def start_allreduce(tensor: torch.Tensor, op: str, group: Group | None) -> collectives.Handle:
    """`allreduce` of `tensor` in place, started: the handle's `wait()` gives `tensor`."""
    engine = context.current()
    staging = _staged(tensor, engine)
    work = engine.backend.allreduce(staging.buffer, "sum" if op == "mean" else op, group)

    def finish() -> torch.Tensor:
        result = staging.copy_back()
        return divide(result, group_size(group)) if op == "mean" else result

    return collectives.Handle(work, finish)


def allgather(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on every rank) concatenated along dim 0."""
    return start_allgather(tensor, [tensor.shape[0]] * group_size(group), group).wait()


def allgather_uneven(tensor: torch.Tensor, lengths: Sequence[int], group: Group | None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0, where rank i's has `lengths[i]` rows
    (known to every rank: nothing is exchanged but the data, padded to the longest)."""
    return start_allgather(tensor, lengths, group).wait()


def start_allgather(tensor: torch.Tensor, lengths: Sequence[int], group: Group | None
                    ) -> collectives.Handle:
    """`allgather_uneven`, started: the handle's `wait()` gives the result."""
    engine = context.current()
    longest = max(lengths)
    padded = tensor
    if tensor.shape[0] < longest:
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
    source = _staged(padded, engine)
    output = _empty((len(lengths) * longest, *tensor.shape[1:]), tensor, engine)
    work = engine.backend.allgather_into(output.buffer, source.buffer, group)

    def finish() -> torch.Tensor:
        gathered = output.copy_back()
        if min(lengths) == longest:
            return gathered
        return torch.cat([gathered[i * longest : i * longest + n] for i, n in enumerate(lengths)])

    return collectives.Handle(work, finish)


def reducescatter(tensor: torch.Tensor, op: str, group: Group | None) -> torch.Tensor:
    """Reduce, then this rank's of `size` equal chunks along dim 0 (`op`: native or "mean")."""
    return start_reducescatter(tensor, op, group).wait()


def start_reducescatter(tensor: torch.Tensor, op: str, group: Group | None) -> collectives.Handle:
    """`reducescatter`, started: the handle's `wait()` gives the result."""
    engine = context.current()
    n = group_size(group)
    source = _staged(tensor, engine)
    output = _empty((tensor.shape[0] // n, *tensor.shape[1:]), tensor, engine)
    native = "sum" if op == "mean" else op
    work = engine.backend.reducescatter_into(output.buffer, source.buffer, native, group)

    def finish() -> torch.Tensor:
        result = output.copy_back()
        return divide(result, n) if op == "mean" else result

    return collectives.Handle(work, finish)


def broadcast(tensor: torch.Tensor, root: int, group: Group | None) -> torch.Tensor:
    """`root`'s tensor (a global rank), as a new tensor on every rank."""
    engine = context.current()
    staging = _staged(tensor.clone(memory_format=torch.contiguous_format), engine)
    engine.backend.broadcast(staging.buffer, root, group).wait(engine.timeout)
    return staging.copy_back()


def reduce(tensor: torch.Tensor, root: int, op: str, group: Group | None) -> torch.Tensor:
    """The reduction onto `root` (a global rank); other ranks get an unspecified tensor."""
    engine = context.current()
    staging = _staged(tensor.clone(memory_format=torch.contiguous_format), engine)
    engine.backend.reduce(staging.buffer, root, op, group).wait(engine.timeout)
    return staging.copy_back()


def alltoall(tensor: torch.Tensor, received: Sequence[int], sent: Sequence[int],
             group: Group | None) -> torch.Tensor:
    """Rows `sent[j]` of `tensor` to group rank j; `received[i]` rows arrive from i, in order."""
    engine = context.current()
    source = _staged(tensor, engine)
    output = _empty((sum(received), *tensor.shape[1:]), tensor, engine)
    engine.backend.alltoall_into(output.buffer, source.buffer, list(received), list(sent),
                                 group).wait(engine.timeout)
    return output.copy_back()


# -- on the caller's buffers ------------------------------------------------------------------
# fully_shard, ZeroOptimizer, the pipeline's links and context parallelism's ring keep their
# own buffers (a unit's gather target, a bucket of shards) and finish the work themselves.
# These start the engine's operation on them, staged through `on_wire` where the engine does not
# take their device, and return the work with the tensors it reads and writes: the caller keeps
# them alive until the work is waited for, and copies a staged result back (`out is not wire`).


def allgather_into(out: torch.Tensor, source: torch.Tensor, group: Group | None
                   ) -> tuple[Work, torch.Tensor, torch.Tensor]:
    """Start gathering every rank's `source` into `out` (group size x its length): (the work,
    the tensor the engine writes, the one it reads)."""
    backend = context.current().backend
    wire, sent = on_wire(out, backend, keep_values=False), on_wire(source, backend)
    return backend.allgather_into(wire, sent, group), wire, sent


def reducescatter_into(out: torch.Tensor, source: torch.Tensor, op: str, group: Group | None
                       ) -> tuple[Work, torch.Tensor, torch.Tensor]:
    """Start reducing `source` (a native `op`) and scattering this rank's chunk into `out`:
    (the work, the tensor the engine writes, the one it reads)."""
    backend = context.current().backend
    wire, sent = on_wire(out, backend, keep_values=False), on_wire(source, backend)
    return backend.reducescatter_into(wire, sent, op, group), wire, sent


def allreduce_into(tensor: torch.Tensor, op: str, group: Group | None) -> tuple[Work, torch.Tensor]:
    """Start reducing `tensor` in place (a native `op`): (the work, the tensor the engine
    reduces)."""
    backend = context.current().backend
    wire = on_wire(tensor, backend)
    return backend.allreduce(wire, op, group), wire


def broadcast_into(tensor: torch.Tensor, root: int, group: Group | None
                   ) -> tuple[Work, torch.Tensor]:
    """Start broadcasting `root`'s `tensor` (a global rank) in place: (the work, the tensor the
    engine sends or overwrites)."""
    backend = context.current().backend
    wire = on_wire(tensor, backend)
    return backend.broadcast(wire, root, group), wire


def send(tensor: torch.Tensor, peer: int, tag: int, group: Group | None) -> tuple[Work, torch.Tensor]:
    """Start sending `tensor` to `peer` (a global rank): (the work, the tensor the engine reads)."""
    backend = context.current().backend
    wire = on_wire(tensor, backend)
    return backend.send(wire, peer, tag, group), wire


def recv(out: torch.Tensor, peer: int, tag: int, group: Group | None) -> tuple[Work, torch.Tensor]:
    """Start receiving from `peer` (a global rank) into `out`: (the work, the tensor the engine
    writes)."""
    backend = context.current().backend
    wire = on_wire(out, backend, keep_values=False)
    return backend.recv(wire, peer, tag, group), wire
