"""Horovod's `alltoall` and `reducescatter` (with their `_async` and grouped spellings); see `ops`.

`reducescatter` accepts a first dimension not divisible by the set's size: the first
`rows % size` ranks get one row more, as in Horovod (each rank's share is padded to the
longest for tandem's equal-chunk reduce-scatter, and the padding cut off again).
"""

from __future__ import annotations

from typing import Any

import torch

import tandem as td
from tandem import functional
from tandem.comm.collectives import direct
from tandem.horovod import engine
from tandem.horovod.basics import (
    Adasum,
    Average,
    Compression,
    compressor,
    global_process_set,
    group_of,
    reduce_op,
)
from tandem.horovod.engine import Description
from tandem.horovod.ops import (
    LINEAR,
    Negotiator,
    ScaleGrad,
    checked,
    differentiable,
    grouped,
    negotiated,
    scale,
    set_size,
    truncating_average,
)


# -- alltoall ---------------------------------------------------------------------------------
def _splits(tensor: torch.Tensor, splits: Any, n: int) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex():
            raise ValueError(f"alltoall splits must be integers, got a {splits.dtype} tensor")
        splits = splits.tolist()
    values = [int(s) for s in splits]
    rows = tensor.shape[0] if tensor.dim() else 0
    if len(values) != n or min(values) < 0 or sum(values) > rows:
        raise ValueError(
            f"alltoall splits {values} must be {n} non-negative counts summing to at most "
            f"dim 0 of the tensor ({rows})"
        )
    return values


def _alltoall_start(tensor, splits, group):
    n = set_size(group)
    sent = _splits(tensor, splits, n)
    if sent is None and (tensor.dim() == 0 or tensor.shape[0] % n):
        raise ValueError(f"alltoall without splits needs dim 0 divisible by {n}; got shape "
                         f"{tuple(tensor.shape)}: pass splits=")
    used = tensor if sent is None or sum(sent) == tensor.shape[0] else tensor[: sum(sent)]

    def start():
        counts = torch.tensor(sent or [used.shape[0] // n] * n, dtype=torch.int64)
        if differentiable(used):
            with checked(group):  # negotiated in forward and backward
                output = functional.all_to_all(used, sent, group)
        else:
            negotiated(group, Description("alltoall", used))
            output = None
        if group is not None:
            received = td.alltoall(counts, splits=[1] * n, group=group)
            output = td.alltoall(used, splits=sent, group=group) if output is None else output
        else:  # negotiated: the counts, then the data, straight to the engine
            received = direct.alltoall(counts, [1] * n, [1] * n, None)
            if output is None:
                output = direct.alltoall(used, received.tolist(), counts.tolist(), None)
        return engine.ready((output, received.to(torch.int32)))

    def finish(result):
        return result[0] if splits is None else result

    return start, finish


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    start, _ = _alltoall_start(tensor.detach(), splits, group_of(process_set))
    return engine.post(name, start)  # synchronize gives (output, received_splits), as Horovod


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send `splits[j]` rows to rank j of the set (equal parts without splits); differentiable.

    Returns the received tensor, and with `splits` also the received splits (int32)."""
    return engine.run(name, *_alltoall_start(tensor, splits, group_of(process_set)))


# -- reducescatter ----------------------------------------------------------------------------
def _reducescatter_start(tensor, op, group, prescale, postscale):
    if op == Adasum:
        raise NotImplementedError("reducescatter with op=hvd.Adasum is not implemented")
    op = reduce_op(None, op)
    if op not in LINEAR:
        raise ValueError(f"reducescatter supports op=Average or Sum, got {op!r}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
    n = set_size(group)
    rows = tensor.shape[0]
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    me = td.rank() if group is None else group.rank

    through_autograd = differentiable(tensor)

    def start():
        negotiated(group, Description("reducescatter", tensor, "sum"))  # the user's shape
        data = scale(tensor if through_autograd else tensor.detach(), prescale)
        if rows % n:  # pad every rank's share to the longest, then cut the padding off
            longest = counts[0]
            parts = []
            for part in torch.split(data, counts):
                pad = longest - part.shape[0]
                parts.append(part if not pad else torch.cat(
                    [part, part.new_zeros((pad, *part.shape[1:]))]))
            data = torch.cat(parts)
        if through_autograd:  # its forward negotiated above; its backward is negotiated too
            with checked(group, Negotiator(after_first=True)):
                out = functional.reduce_scatter(ScaleGrad.apply(data, float(n)), "sum", 0, group)
            return engine.ready(scale(out / n if op == Average else out, postscale)[: counts[me]])
        if group is None:
            return direct.start_reducescatter(data.contiguous(), "sum", None)
        return td.reducescatter(data.contiguous(), op="sum", async_op=True, group=group)

    def finish(out):
        if through_autograd:  # scaled and averaged already
            return out
        if op == Average:
            out = truncating_average(out, n)
        return scale(out[: counts[me]], postscale)

    return start, finish


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    return engine.post(name, *_reducescatter_start(tensor.detach(), op, group_of(process_set),
                                                   prescale_factor, postscale_factor))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set, then rank i keeps the i-th block of rows; differentiable."""
    codec = compressor(compression)
    wire, ctx = codec.compress(tensor)
    start, finish = _reducescatter_start(wire, op, group_of(process_set), prescale_factor,
                                         postscale_factor)
    return codec.decompress(engine.run(name, start, finish), ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    group = group_of(process_set)
    return grouped(name, [_reducescatter_start(t.detach(), op, group, prescale_factor,
                                                postscale_factor) for t in tensors])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    codec = compressor(compression)
    wires = [codec.compress(t) for t in tensors]
    group = group_of(process_set)
    handle = grouped(name, [_reducescatter_start(w, op, group, prescale_factor, postscale_factor)
                             for w, _ in wires])
    out = engine.synchronize(handle)
    return [codec.decompress(r, ctx) for r, (_, ctx) in zip(out, wires, strict=True)]
