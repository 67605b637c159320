"""The split's attention as torch custom operators, for a compiled model (`torch.compile`).

Dynamo cannot trace tandem's engine (Python calls into Gloo or MPI, asynchronous handles, a
watchdog). While it traces a split model's forward, the split's torch function mode is on its
stack and traced with it: the mode meets each attention call (`F.scaled_dot_product_attention`,
or inside `nn.MultiheadAttention` through `mha`), and `apply._Split.attend` puts these operators
in the graph in its place. Inductor calls them at run time, and they run the eager code:

- `cp_header`: the call's header (`wire`): its number in this forward, counted when the graph
  runs, and codes of its module and arguments; an empty tensor with checks off (then only
  counted, for the forward's "no attention call" check). Its output feeds the messages, so the
  call is counted before it communicates;
- `cp_ring` / `cp_ring_backward`: `ring.ring_forward` and `ring.ring_backward` (the output and
  its log-sum-exp forward; the gradients of q, k and v backward);
- `cp_alltoall`: one all-to-all of the all-to-all form, whose backward is the reverse one; the
  attention between the two is torch's own, traced (inductor picks its kernel).

Arguments are tensors, numbers and strings only, so a split travels as its key (`remember`),
found again at run time. Each message carries the header as in eager mode: a rank whose graph
skips an attention call is named.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from tandem.comm.groups import group_size
from tandem.parallel.context import ring, ulysses, wire

_splits: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_keys = itertools.count()


def remember(split: Any) -> int:
    """A key for `split` that an operator can take (kept as long as the split lives)."""
    key = next(_keys)
    _splits[key] = split
    return key


def _split(key: int) -> Any:
    found = _splits.get(key)
    if found is None:
        raise RuntimeError(f"a compiled context-parallel attention call refers to split #{key}, "
                           "whose model no longer exists: compile the model that runs")
    return found


def _header(header: torch.Tensor) -> torch.Tensor | None:
    return header if header.numel() else None


# -- the operators ----------------------------------------------------------------------------


@torch.library.custom_op("tandem::cp_header", mutates_args=())
def cp_header(query: torch.Tensor, causal: bool, scale: float, mask: list[int] | None,
              module: str, checked: bool, split: int) -> torch.Tensor:
    """Count this attention call; its header (`wire.header_of`), or an empty tensor unchecked."""
    header = _split(split).header(tuple(query.shape), query.dtype, causal, scale, mask, module,
                                  checked)
    return torch.empty(0, dtype=torch.int64) if header is None else header


@cp_header.register_fake
def _(query, causal, scale, mask, module, checked, split):
    return torch.empty(wire.HEADER if checked else 0, dtype=torch.int64)


@torch.library.custom_op("tandem::cp_ring", mutates_args=())
def cp_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, header: torch.Tensor,
            causal: bool, scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward: the output and its log-sum-exp (q, k, v: (batch, seq, dim))."""
    found = _split(split)
    out, lse = ring.ring_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale,
                                 found.group, _header(header), found.owner, found.names)
    return out.contiguous(), lse.contiguous()


@cp_ring.register_fake
def _(q, k, v, header, causal, scale, split):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=ring.lse_dtype(q))


@torch.library.custom_op("tandem::cp_ring_backward", mutates_args=())
def cp_ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, header: torch.Tensor, causal: bool,
                     scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward: the gradients of this rank's q, k and v."""
    dq, dk, dv = ring.ring_backward(dout, *(t.contiguous() for t in (q, k, v, out, lse)), causal,
                                    scale, _split(split).group, _header(header))
    # contiguous, as the fake says; dk and dv came in one message: outputs share no storage
    return dq.contiguous(), dk.contiguous(), dv.clone(memory_format=torch.contiguous_format)


@cp_ring_backward.register_fake
def _(dout, q, k, v, out, lse, header, causal, scale, split):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_keep(ctx, inputs, output) -> None:
    q, k, v, header, causal, scale, split = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], header)
    ctx.rest = (causal, scale, split)


def _ring_backward(ctx, dout, _dlse):
    dq, dk, dv = cp_ring_backward(dout, *ctx.saved_tensors, *ctx.rest)
    return dq, dk, dv, None, None, None, None


cp_ring.register_autograd(_ring_backward, setup_context=_ring_keep)


@torch.library.custom_op("tandem::cp_alltoall", mutates_args=())
def cp_alltoall(tensor: torch.Tensor, header: torch.Tensor, scatter: int, gather: int,
                split: int, read: bool) -> torch.Tensor:
    """Cut along `scatter`, exchange over the split's group, join along `gather` (`read`: the
    headers received are compared with this rank's; the backward's are only skipped)."""
    found = _split(split)
    return ulysses.exchange(tensor, scatter, gather, found.group, _header(header), found.owner,
                            found.names, read).contiguous()


@cp_alltoall.register_fake
def _(tensor, header, scatter, gather, split, read):
    sp = group_size(_split(split).group)
    shape = list(tensor.shape)
    shape[scatter] //= sp
    shape[gather] *= sp
    return tensor.new_empty(shape)


def _alltoall_keep(ctx, inputs, output) -> None:
    tensor, header, scatter, gather, split, read = inputs
    ctx.save_for_backward(header)
    ctx.rest = (scatter, gather, split)


def _alltoall_backward(ctx, grad):
    (header,) = ctx.saved_tensors
    scatter, gather, split = ctx.rest
    return cp_alltoall(grad, header, gather, scatter, split, False), None, None, None, None, None


cp_alltoall.register_autograd(_alltoall_backward, setup_context=_alltoall_keep)


# -- the two forms, as traced (`apply._Split.attend` calls these while compiling) --------------


def header(split: int, query: torch.Tensor, causal: bool, scale: float,
           mask: torch.Tensor | None, module: str, checked: bool) -> torch.Tensor:
    shape = None if mask is None else list(mask.shape)
    return cp_header(query.detach(), causal, scale, shape, module, checked, split)


def ring_attention(q, k, v, *, causal: bool, scale: float, header: torch.Tensor,
                   split: int) -> torch.Tensor:
    """`ring.ring_attention`, compiled: any leading dims, flattened for the operator."""
    shape = q.shape
    flat = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
    out, _ = cp_ring(*flat, header, causal, scale, split)
    return out.reshape(shape)


def ulysses_attention(q, k, v, *, attn_mask, dropout_p: float, causal: bool, scale: float,
                      header: torch.Tensor, split: int, group, owner: str) -> torch.Tensor:
    """`ulysses.ulysses_attention`, compiled: its all-to-alls are `cp_alltoall`."""
    def exchange(tensor, scatter, gather):
        return cp_alltoall(tensor, header, scatter, gather, split, True)

    return ulysses.ulysses_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                     causal=causal, scale=scale, group=group, header=None,
                                     owner=owner, names={}, exchange=exchange)
