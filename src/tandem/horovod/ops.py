"""Horovod's collectives (`allreduce`, `allgather`, `broadcast`, `alltoall`, `reducescatter`, their
`_async`, in-place and grouped spellings) over tandem's, with Horovod's semantics:

- A tensor that requires grad goes through `tandem.functional`, with Horovod's gradient
  conventions on top: allgather's and broadcast's backward average over the set instead of
  summing, reducescatter's is multiplied by the set's size.
- `prescale_factor` / `postscale_factor` scale integers in float64 and half floats in float32
  (CPU), then cast back, as Horovod does; an integer average truncates toward zero.
- `reducescatter` accepts a first dimension not divisible by the set's size: the first
  `rows % size` ranks get one row more, as in Horovod.
- Operations run in posting order (see `engine`); `process_set=` picks the group.

On the global set each operation is one negotiation (`engine.negotiate`: tandem's agreement,
which joined ranks answer) and then its data, straight to the engine (`comm/collectives/direct.py`); a
differentiable one negotiates its backward's collective too (`functional.checked_by`). On a
process set, which joined ranks do not answer, tandem's own collectives run, with their
argument check: two messages per operation either way.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

import tandem as td
from tandem import functional, runtime
from tandem.comm.agreement import exchange
from tandem.comm.agreement.agree import CollectiveMismatchError
from tandem.comm.collectives import direct
from tandem.comm.collectives.user import Staging
from tandem.horovod import engine, timeline
from tandem.horovod.basics import (
    Average,
    Compression,
    HorovodMismatchError,
    ProcessSet,
    Sum,
    compressor,
    global_process_set,
    group_of,
    reduce_op,
)
from tandem.horovod.engine import Description

LINEAR = (Average, Sum)


class ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient multiplied by `factor` backward."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor * factor` in Horovod's arithmetic: integers in float64, CPU halves in float32."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() and tensor.dtype in (torch.float16, torch.bfloat16) \
            and tensor.device.type == "cpu":
        return (tensor.float() * factor).to(tensor.dtype)
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return (tensor.double() * factor).to(tensor.dtype)
    return tensor * factor


def truncating_average(tensor: torch.Tensor, n: int) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(n)
    return tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


def set_size(group) -> int:
    return td.size() if group is None else group.size


def negotiated(group, description: Description) -> None:
    if group is None:  # join and the argument check are global, as in Horovod
        engine.negotiate(description)


class Negotiator:
    """`td.functional`'s per-call check on the global set: Horovod's negotiation, in forward and
    backward alike. `after_first`: the forward was negotiated already, by its caller."""

    def __init__(self, after_first: bool = False) -> None:
        self.skip = after_first

    def __call__(self, collective: str, tensor: torch.Tensor, group, *, op: str | None = None,
                 root: int | None = None, ignore_dim0: bool = False) -> None:
        if self.skip:
            self.skip = False
            return
        engine.negotiate(Description(collective, tensor, op or "sum",
                                     -1 if root is None else root, ignore_dim0))


def checked(group, negotiator: Negotiator | None = None):
    """Where `td.functional` runs for Horovod: negotiated on the global set (joined ranks answer
    its allreduces), tandem's own check on a process set."""
    if group is not None:
        return contextlib.nullcontext()
    return functional.checked_by(negotiator or Negotiator())


def allgathered(tensor: torch.Tensor, group):
    """Every rank's tensor along dim 0 (first dims may differ), started after the negotiation:
    the lengths, then the data, straight to the engine (a process set: td.allgather, checked).
    Returns a handle."""
    if group is not None:
        return td.allgather(tensor, async_op=True, group=group)
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    lengths = exchange.lengths(tensor.shape[0], None, runtime.state())
    return direct.start_allgather(tensor, lengths, None)


# -- allreduce --------------------------------------------------------------------------------
def _allreduce_start(tensor, op, prescale, postscale, group, inplace):
    """What starts one allreduce: returns a waitable whose result is the reduced tensor."""
    through_autograd = differentiable(tensor) and not inplace

    def start():
        if through_autograd:
            if op not in LINEAR:
                raise ValueError(f"allreduce of a tensor that requires grad needs op=Average or "
                                 f"Sum, got {op!r}")
            with checked(group):  # the negotiation is the call's check, forward and backward
                reduced = functional.all_reduce(scale(tensor, prescale), op, group)
            return engine.ready(scale(reduced, postscale))
        native = "sum" if op == Average else op
        negotiated(group, Description("allreduce", tensor, native))
        work = tensor if inplace else tensor.detach()
        scaled = work if prescale == 1.0 else scale(work, prescale)  # (the usual 1.0: no call)
        work = scaled if scaled is not work or inplace else work.clone()
        if group is None:  # negotiated: the data goes straight to the engine
            return direct.start_allreduce(work, native, None)
        return td.allreduce(work, op=native, inplace=True, async_op=True, group=group)

    def finish(result):
        if through_autograd:  # scaled and averaged already
            return result
        if op == Average:
            truncating_average(result, set_size(group))
        if postscale != 1.0:
            result = scale(result, postscale)
        if inplace and result is not tensor:
            tensor.copy_(result)
            return tensor
        return result

    return start, finish


def answer_allreduce(dtype: torch.dtype, shape: list[int], op: str) -> None:
    """A joined rank's share of an allreduce: zeros (the others' data goes to the engine as it
    is, after the negotiation this rank answered)."""
    direct.allreduce(torch.zeros(shape, dtype=dtype), op, None, inplace=True)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    group = group_of(process_set)
    start, finish = _allreduce_start(tensor, reduce_op(average, op), prescale_factor,
                                     postscale_factor, group, inplace=True)
    return engine.post(name, start, finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    group = group_of(process_set)
    start, finish = _allreduce_start(tensor.detach(), reduce_op(average, op), prescale_factor,
                                     postscale_factor, group, inplace=False)
    return engine.post(name, start, finish)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    return engine.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction over the set, as a new tensor; differentiable (backward: the same allreduce)."""
    if name is None and process_set is global_process_set and compression is Compression.none \
            and average is None and prescale_factor == 1.0 and postscale_factor == 1.0 \
            and tensor.__class__ is torch.Tensor and not engine.pending \
            and not (tensor.requires_grad and torch.is_grad_enabled()) \
            and not timeline.recording():
        # The common case written out (issue 46, item 2): nothing posted before it, so it runs
        # now, without a handle: the negotiation, then the data straight to the engine.
        return _allreduce_now(tensor, Average if op is None else op)
    codec = compressor(compression)
    wire, ctx = codec.compress(tensor)
    group = group_of(process_set)
    start, finish = _allreduce_start(wire, reduce_op(average, op), prescale_factor,
                                     postscale_factor, group, inplace=False)
    return codec.decompress(engine.run(name, start, finish), ctx)


def _allreduce_now(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """`allreduce` of a plain tensor on the global set, blocking, as `_allreduce_start`'s
    operation would run it."""
    if op not in _NATIVE_OF:
        op = reduce_op(None, op)  # raises with the fix
    state = runtime.state()
    native = _NATIVE_OF[op]
    try:
        engine.negotiate(Description("allreduce", tensor, native))
    except CollectiveMismatchError as error:  # as a handle raises it
        raise error if isinstance(error, RuntimeError) else HorovodMismatchError(str(error)) \
            from None
    staging = Staging(tensor.detach().clone(), state)
    work = state.backend.allreduce_now(staging.buffer, native, None)
    if work is not None:
        work.wait(state.timeout)
    result = staging.copy_back()
    if op == Average:
        truncating_average(result, state.world.size)
    return result


_NATIVE_OF = {Average: "sum", Sum: "sum", "min": "min", "max": "max", "product": "product"}


class _Many:
    """Several waitables as one: the grouped operations' handle."""

    def __init__(self, works: list[Any], finishes: list[Any]) -> None:
        self.works, self.finishes = works, finishes

    def done(self) -> bool:
        return all(work.done() for work in self.works)

    def wait(self) -> list[Any]:
        return [work.wait() if finish is None else finish(work.wait())
                for work, finish in zip(self.works, self.finishes, strict=True)]


def grouped(name, starts_and_finishes):
    def start():
        return _Many([s() for s, _ in starts_and_finishes], [f for _, f in starts_and_finishes])

    return engine.post(name, start)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    group, op = group_of(process_set), reduce_op(average, op)
    return grouped(name, [_allreduce_start(t.detach(), op, prescale_factor, postscale_factor,
                                            group, inplace=False) for t in tensors])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    group, op = group_of(process_set), reduce_op(average, op)
    return grouped(name, [_allreduce_start(t, op, prescale_factor, postscale_factor, group,
                                            inplace=True) for t in tensors])


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return engine.synchronize(grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Each tensor's allreduce, in one call; differentiable."""
    codec = compressor(compression)
    wires = [codec.compress(t) for t in tensors]
    group, op = group_of(process_set), reduce_op(average, op)
    handle = grouped(name, [_allreduce_start(w, op, prescale_factor, postscale_factor, group,
                                              inplace=False) for w, _ in wires])
    reduced = engine.synchronize(handle)
    return [codec.decompress(r, ctx) for r, (_, ctx) in zip(reduced, wires, strict=True)]


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """A sparse tensor's allreduce: indices and values gathered from every rank, then summed.

    Returns a function, as Horovod does: `handle()` waits and gives the (coalesced) result."""
    group, op = group_of(process_set), reduce_op(None, op)
    if op not in LINEAR:
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, not {op!r}")
    sparse = tensor.coalesce()
    indices, values = sparse.indices().t().contiguous(), sparse.values()

    def start():
        negotiated(group, Description("allgather", values))
        gathered = allgathered(values, group).wait()
        negotiated(group, Description("allgather", indices))
        where = allgathered(indices, group).wait().t()
        if op == Average:
            gathered = gathered / set_size(group)
        return engine.ready(torch.sparse_coo_tensor(where, gathered, sparse.shape).coalesce())

    handle = engine.post(name, start)
    return lambda: engine.synchronize(handle)  # Horovod's: call it to wait for the result


# -- allgather and broadcast --------------------------------------------------------------------
def _allgather_start(tensor, group):
    def start():
        if differentiable(tensor):
            averaged = ScaleGrad.apply(tensor, 1.0 / set_size(group))
            with checked(group):
                return engine.ready(functional.all_gather(averaged, 0, group))
        negotiated(group, Description("allgather", tensor))
        return allgathered(tensor, group)

    return start, None


def allgather_async(tensor, name=None, process_set=global_process_set):
    return engine.post(name, *_allgather_start(tensor.detach(), group_of(process_set)))


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0 (first dims may differ); differentiable."""
    return engine.run(name, *_allgather_start(tensor, group_of(process_set)))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    group = group_of(process_set)
    return grouped(name, [_allgather_start(t.detach(), group) for t in tensors])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    group = group_of(process_set)
    return engine.synchronize(grouped(name, [_allgather_start(t, group) for t in tensors]))


def _broadcast_start(tensor, root_rank, group, inplace):
    if not isinstance(root_rank, int) or not 0 <= root_rank < td.size():
        raise ValueError(f"root_rank={root_rank!r}: give the global rank of the root (the job "
                         f"has {td.size()} ranks)")

    def start():
        if differentiable(tensor) and not inplace:
            averaged = ScaleGrad.apply(tensor, 1.0 / set_size(group))
            with checked(group):
                return engine.ready(functional.broadcast(averaged, root_rank, group))
        negotiated(group, Description("broadcast", tensor, root=root_rank))
        if group is not None:
            return td.broadcast(tensor, root=root_rank, inplace=inplace, async_op=True,
                                group=group)
        result = direct.broadcast(tensor, root_rank, None)
        return engine.ready(tensor.copy_(result) if inplace else result)

    return start, None


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return engine.post(name, *_broadcast_start(tensor, root_rank, group_of(process_set), True))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return engine.post(name, *_broadcast_start(tensor.detach(), root_rank, group_of(process_set),
                                               False))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return engine.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """`root_rank`'s tensor on every rank of the set; differentiable."""
    return engine.run(name, *_broadcast_start(tensor, root_rank, group_of(process_set), False))


# -- the rest ---------------------------------------------------------------------------------
def barrier(process_set=global_process_set) -> None:
    td.barrier(group=group_of(process_set))


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    engine.start_pending()
    return td.broadcast_object(obj, root=root_rank, group=group_of(process_set))


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    engine.start_pending()
    return td.allgather_object(obj, group=group_of(process_set))


def join(device: int = -1) -> int:
    """Answer the other ranks' operations until every rank has joined; returns the last to join.

    With a `DistributedOptimizer` in the process, this answers its gradient reductions
    (`td.join()`: the ranks out of data count as zero gradients); otherwise it answers the
    other ranks' `hvd.allreduce`s with zeros (see `engine`).
    """
    from tandem.parallel.data_parallel.reducer import live_reducers

    engine.start_pending()
    if live_reducers():
        gc.collect()  # optimizers the script dropped must not count
    if live_reducers():
        return td.join()
    return engine.join_rounds(answer_allreduce)

