"""The all-to-all form (DeepSpeed-Ulysses): heads for the sequence, around attention only.

Outside attention each rank holds its part of the sequence (all heads). Around one attention
call, one all-to-all sends each rank the whole sequence of `heads / sp` heads (q, k and v in one
message), attention runs on those heads as in one process (any mask over the whole sequence,
`F.scaled_dot_product_attention` itself), and a second all-to-all gives each rank back its part
of the sequence, all heads. Each all-to-all's backward is the other one. Heads must divide by
the group's size; the ring form has no such limit.

The gathered sequence comes in rank order, each rank's part in the head-tail layout; it is put
in order (one local gather of rows) only where order matters: under a causal mask or a mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size
from tandem.parallel.context import layout, wire

_SDPA = F.scaled_dot_product_attention  # torch's own (`apply` renames F's during some calls)


class _AllToAll(torch.autograd.Function):
    """Cut along `scatter`, exchange, join along `gather`; the backward the reverse."""

    @staticmethod
    def forward(ctx, tensor, scatter, gather, group, header, owner, names):
        ctx.scatter, ctx.gather, ctx.group, ctx.header = scatter, gather, group, header
        return exchange(tensor, scatter, gather, group, header, owner, names)

    @staticmethod
    def backward(ctx, grad):
        out = exchange(grad, ctx.gather, ctx.scatter, ctx.group, ctx.header, "", {}, read=False)
        return out, None, None, None, None, None, None


def exchange(tensor: torch.Tensor, scatter: int, gather: int, group: Group | None,
             header: torch.Tensor | None, owner: str, names: dict[int, str],
             read: bool = True) -> torch.Tensor:
    """One all-to-all (`wire.alltoall`); checked and `read`, refused if the ranks diverged."""
    out, headers = wire.alltoall(tensor.contiguous(), scatter, gather, group, header, read)
    if headers is not None:
        wire.refuse_diverged(header.tolist(), dict(enumerate(headers)), group, owner, names)
    return out


def heads_per_rank(heads: int, sp: int, where: str) -> int:
    if heads % sp:
        raise ValueError(
            f"{where}: {heads} attention heads cannot be shared out over the {sp} ranks of the "
            f"context-parallel group: the all-to-all form gives each rank heads / sp whole heads, "
            f"so the number of heads must be a multiple of {sp}. Use style='ring' (ring attention "
            f"splits no heads: any number works), or a group whose size divides {heads}.")
    return heads // sp


def ulysses_attention(q, k, v, *, attn_mask, dropout_p: float, causal: bool, scale,
                      group: Group | None, header, owner: str, names: dict[int, str],
                      exchange: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """Attention over the whole sequence for q, k, v of shape (batch, heads, local seq, dim).
    `exchange(tensor, scatter, gather)`: the all-to-all (by default `_AllToAll`; compiled, the
    custom operator of `ops`); attention in between is torch's own, traced when compiled."""
    if exchange is None:
        def exchange(tensor, scatter, gather):
            return _AllToAll.apply(tensor, scatter, gather, group, header, owner, names)
    sp = group_size(group)
    heads = q.shape[1]
    local = heads_per_rank(heads, sp, f"attention in {owner}")
    qkv = exchange(torch.stack([q, k, v]), 2, 3)  # (3, B, H/sp, T, D)
    length = qkv.shape[3]
    ordered = causal or attn_mask is not None
    if ordered:  # rank order -> sequence order
        where = layout.gathered_positions(sp, length, q.device)
        qkv = qkv.index_select(3, torch.argsort(where))
    if attn_mask is not None:
        attn_mask = _my_heads(attn_mask, heads, local, group)
    out = _SDPA(qkv[0], qkv[1], qkv[2], attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=causal, scale=scale)
    if ordered:  # and back to rank order
        out = out.index_select(2, where)
    return exchange(out.unsqueeze(0), 3, 2)[0]


def _my_heads(mask: torch.Tensor, heads: int, local: int, group: Group | None) -> torch.Tensor:
    """A mask given per head keeps this rank's heads; one shared by the heads stays as it is."""
    if mask.dim() >= 3 and mask.shape[-3] == heads and heads > 1:
        return mask.narrow(-3, group_rank(group) * local, local)
    return mask
