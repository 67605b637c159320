"""Ring attention: each rank keeps its queries; key/value blocks travel around the ring.

At step s rank r holds the keys and values of rank r - s. It attends its queries to that block
and folds the result into what it has with an online softmax (each row keeps its log-sum-exp,
`lse`: two partial results merge exactly as one softmax over both blocks would), while the
block moves on to rank r + 1. After sp steps every query has seen every key, and no rank ever
held more than two blocks: memory per rank does not grow with the number of ranks.

The backward is written out (an autograd function), not left to autograd over the forward,
which would keep every block it received. It saves only the local q, k, v, the output and the
lse, and sends the blocks around again, each with the gradient of its keys and values
accumulated by every rank it visits; one last hop takes those gradients home.

Causal masks use the head-tail layout (`layout`): rank r holds chunks r and 2sp-1-r. Against
its own block a rank needs the causal mask; against an earlier rank's block (o < r) all its
queries see that block's first chunk and nothing of its second; against a later one (o > r)
only its second chunk's queries see anything, all of the block. Every step does the same
amount of work on every rank, and no step computes a score the mask hides.
"""

from __future__ import annotations

import torch

from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size
from tandem.parallel.context import wire


def _plan(me: int, origin: int, causal: bool, half: int):
    """(query rows, key rows, causal) for this rank's queries against `origin`'s block: only
    the rows and keys the mask leaves anything of (in the head-tail layout, never nothing)."""
    every = slice(None)
    if not causal:
        return every, every, False
    if origin == me:
        return every, every, True
    if origin < me:
        return every, slice(0, half), False
    return slice(half, None), every, False


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _fused(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel (flash attention for CPU) takes these blocks."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                   torch.float16)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: float32, or float64 for float64 (as torch's kernels keep it)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block(q, k, v, scale, causal):
    """One block: its output and log-sum-exp per query row (`lse_dtype`). `causal`: the queries
    and keys are the same positions (a rank's own block, where, in the head-tail layout, the
    causal mask over the local order is the global one)."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), 0.0, causal, scale=scale)
        return out.squeeze(1), lse.squeeze(1).to(lse_dtype(q))
    s = _scores(q, k, scale, causal).to(lse_dtype(q))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(v.dtype), v), lse


def _block_backward(dout, q, k, v, out, lse, scale, causal):
    """The gradients of one block's q, k and v, given the output and log-sum-exp over the
    whole sequence (flash attention's backward, block by block)."""
    if _fused(q):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.unsqueeze(1), q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), out.unsqueeze(1),
            lse.unsqueeze(1), 0.0, causal, scale=scale)
        return tuple(g.squeeze(1) for g in grads)
    p = torch.exp(_scores(q, k, scale, causal).to(lse.dtype) - lse.unsqueeze(-1)).to(q.dtype)
    delta = (dout * out).sum(-1, keepdim=True)  # D_i = sum_j P_ij dP_ij
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
    return (torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale,
            torch.matmul(p.transpose(-1, -2), dout))


def ring_forward(q, k, v, causal: bool, scale: float, group: Group | None,
                 header: torch.Tensor | None, owner: str, names: dict[int, str]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output over the whole sequence and its log-sum-exp per query row (q, k, v:
    (batch, this rank's sequence, dim)). Checked (`header`): refuses a diverged ring."""
    me, sp = group_rank(group), group_size(group)
    ring = wire.Ring(group)
    half = q.shape[-2] // 2
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q), device=q.device)
    checked = header is not None
    seen: dict[int, list[int]] = {}
    carried = header  # the header the block in hand came with (its origin's)
    block_k, block_v = k, v
    for step in range(sp):
        origin = (me - step) % sp
        pending = ring.start(wire.pack([block_k, block_v], carried)) if step < sp - 1 else None
        rows, keys, masked = _plan(me, origin, causal, half)
        o_b, lse_b = _block(q[..., rows, :], block_k[..., keys, :], block_v[..., keys, :],
                            scale, masked)
        new = torch.logaddexp(lse[..., rows], lse_b)
        out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - new).unsqueeze(-1)
                             + o_b * torch.exp(lse_b - new).unsqueeze(-1)).to(q.dtype)
        lse[..., rows] = new
        if pending is not None:
            (block_k, block_v), got = wire.unpack(pending.wait(), k, 2, checked)
            if checked:
                seen[(origin - 1) % sp] = got
                carried = torch.tensor(got, dtype=torch.int64)
    if checked:
        wire.refuse_diverged(header.tolist(), seen, group, owner, names)
    return out, lse


def ring_backward(dout, q, k, v, out, lse, causal: bool, scale: float, group: Group | None,
                  header: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of this rank's q, k and v (`ring_forward`'s saved tensors given)."""
    me, sp = group_rank(group), group_size(group)
    ring = wire.Ring(group)
    half = q.shape[-2] // 2
    checked = header is not None
    dout = dout.contiguous()
    dq = torch.zeros_like(q)
    block_k, block_v = k, v
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for step in range(sp):
        origin = (me - step) % sp
        rows, keys, masked = _plan(me, origin, causal, half)
        dq_b, dk_b, dv_b = _block_backward(dout[..., rows, :], q[..., rows, :],
                                           block_k[..., keys, :], block_v[..., keys, :],
                                           out[..., rows, :], lse[..., rows], scale, masked)
        dq[..., rows, :] += dq_b
        dk[..., keys, :] += dk_b
        dv[..., keys, :] += dv_b
        # The block moves on with its gradients; after the last step only the gradients
        # travel, one hop home (rank r then holds the gradients of its own k and v).
        tensors = [block_k, block_v, dk, dv] if step < sp - 1 else [dk, dv]
        # (the headers travel as in forward, unread: a forward that diverged never got here)
        received, _ = wire.unpack(ring.start(wire.pack(tensors, header)).wait(), k,
                                  len(tensors), checked, read=False)
        if step < sp - 1:
            block_k, block_v, dk, dv = received
        else:
            dk, dv = received
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Eager autograd over `ring_forward` / `ring_backward` (compiled: `ops.cp_ring`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, header, owner, names):
        out, lse = ring_forward(q, k, v, causal, scale, group, header, owner, names)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.header = causal, scale, group, header
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = ring_backward(dout, *ctx.saved_tensors, ctx.causal, ctx.scale, ctx.group, ctx.header)
        return *grads, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   scale: float, group: Group | None, header: torch.Tensor | None,
                   owner: str, names: dict[int, str]) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, q, k, v holding this rank's part
    (head-tail layout, any leading dims)."""
    shape = q.shape
    flat = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
    return RingAttention.apply(*flat, causal, scale, group, header, owner, names).reshape(shape)
