"""Cross-entropy over logits whose vocabulary is split over the group (Megatron's recipe).

The full logits are never gathered: the group agrees on the row maxima (all-reduce max), the
sums of exponentials and the target logits (one all-reduce sum of both), and the gradient,
`softmax - one_hot`, is computed on each rank's slice without communicating.
"""

from __future__ import annotations

import torch

from tandem.comm import collectives
from tandem.comm.groups import Group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        n = group_size(group)
        local = logits.shape[-1]
        start = group_rank(group) * local
        ctx.dtype = logits.dtype
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        row_max = logits.max(dim=-1, keepdim=True).values
        if n > 1:
            row_max = collectives.allreduce(row_max.contiguous(), "max", group=group)
        shifted = logits - row_max
        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([exp.sum(dim=-1), picked])
        if n > 1:
            both = collectives.allreduce(both.contiguous(), "sum", group=group)
        sum_exp, target_logit = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside = ctx.saved_tensors
        result = softmax.clone()
        hit = (~outside).to(result.dtype)
        result.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return (result * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Group | None = None, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits, target)` from this rank's slice of the last dim of the logits.

    `logits`: (..., vocab / tp), the output of a ColumnParallelLinear without gather; `target`:
    (...) of global class ids. `reduction` is "mean", "sum" or "none".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; "
                         "use 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} need target of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    losses = _VocabParallelCrossEntropy.apply(logits, target, group)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()
