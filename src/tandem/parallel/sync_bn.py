"""`SyncBatchNorm`: batch statistics over every rank of the group, not just this rank's batch.

    model = td.SyncBatchNorm.convert(model)   # every BatchNorm*d becomes a SyncBatchNorm

With small per-rank batches, BatchNorm's per-rank statistics are noisy and differ from what
one process with the whole batch computes. In training, this module:

- forward: each rank computes its own (count, mean, M2) per channel (M2: the sum of squared
  deviations from its own mean, a stable two-pass/Welford reduction), the ranks all-gather
  them (one message of 2C+1 numbers per rank, as torch's SyncBatchNorm gathers mean, invstd
  and count), and every rank merges them in rank order with Chan's parallel update:
  mean = Σ nᵣ·meanᵣ / N, M2 = Σ M2ᵣ + Σ nᵣ·(meanᵣ − mean)². It normalises with that mean and
  the biased variance M2 / N, as (x − mean)·(invstd·weight) + bias, and updates the running
  statistics with the mean and the unbiased variance M2 / (N − 1), so they stay equal on every
  rank;
- backward: all-reduces [sum(dy), sum(dy·(x − mean))] per channel (2C numbers), which is what
  the input gradient needs from the other ranks' samples. The weight and bias gradients stay
  local: the gradient reducer averages them like any other parameter's.

Together, k ranks with batch B/k give the output, gradients and running statistics of one
process with batch B, whatever the mean of a channel is against its spread: no step
subtracts two large numbers (the variance as E[x²] − E[x]², which this module once used, lost
2.7e-3 of the variance in float32 at mean/std = 100; the merge keeps ~1e-7). Ranks may hold
different batch sizes, a batch of 0 included: such a rank sends count 0, takes part in both
messages and gets an empty output (it must still run backward when the others do).

Precision follows torch's own BatchNorm on the device: statistics and the normalisation are
computed in float64 on the CPU for float32 inputs (torch's CPU kernels accumulate in double),
in float32 on GPUs and for half types. Eval mode uses the running statistics and communicates
nothing; so does a world of one.

By default the statistics travel on a private copy of the world group, created once by
`convert` (or the first training forward): they then never queue behind a 25 MB gradient
bucket in flight, and their order cannot interleave differently with the reducer's on
different ranks. With an explicit `group=` (e.g. a mesh's data-parallel group), that group is
used as is.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tandem import runtime
from tandem.comm.collectives import direct
from tandem.comm.groups import Group, group_size, new_group
from tandem.parallel.data_parallel.join import join_active

_private: list = []  # [(weakref to the RuntimeState it belongs to, Group)]


def _private_world_group() -> Group:
    state = runtime.state()
    if _private and _private[0][0]() is state:
        return _private[0][1]
    group = new_group(range(runtime.size()))  # collective: every rank gets here together
    _private[:] = [(weakref.ref(state), group)]
    return group


def _allreduce(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    work, message = direct.allreduce_into(tensor, "sum", group)
    work.wait(runtime.state().timeout)
    return message.to(tensor.device)


def _allgather(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Every rank's `tensor` (1-D, the same length everywhere), as rows in group order."""
    rows = torch.empty(group_size(group) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work, rows, _sent = direct.allgather_into(rows, tensor, group)
    work.wait(runtime.state().timeout)
    return rows.view(group_size(group), -1).to(tensor.device)


def _accumulator(x: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics: torch's BatchNorm accumulates float32 in double on the CPU,
    in float on GPUs, and half types in float."""
    if x.dtype == torch.float64 or (x.dtype == torch.float32 and x.device.type == "cpu"):
        return torch.float64
    return torch.float32


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view(1, -1, *([1] * (ndim - 2)))


def merge(stats: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan's parallel update of rows [count, mean (C), M2 (C)]: (N, mean, M2) of their union.

    Rows with count 0 add nothing; with no sample at all, mean and M2 are 0. A pure function of
    the gathered rows, so every rank computes the same bits from the same message.
    """
    counts = stats[:, :1]
    means, m2s = stats[:, 1 : channels + 1], stats[:, channels + 1 :]
    total = counts.sum()
    weights = counts / total.clamp_min(1)
    mean = (weights * means).sum(0)
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return total, mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channels, ndim = x.shape[1], x.dim()
        dims = [0, *range(2, ndim)]
        acc = _accumulator(x)
        xa = x.to(acc)
        local = torch.zeros(2 * channels + 1, dtype=acc, device=x.device)
        count = x.numel() // max(channels, 1)  # known here: no host sync
        if count:  # a rank with an empty batch sends zeros, and still sends
            var, mean = torch.var_mean(xa, dim=dims, correction=0)
            local[0] = count
            local[1 : channels + 1] = mean
            torch.mul(var, count, out=local[channels + 1 :])
        total, mean, m2 = merge(_allgather(local, group), channels)
        var = m2 / total.clamp_min(1)
        # No sample on any rank: nothing to learn, the running statistics stay as they are.
        seen = total > 0
        if running_mean is not None:
            updated = running_mean * (1 - factor) + mean.to(running_mean.dtype) * factor
            running_mean.copy_(torch.where(seen, updated, running_mean))
        if running_var is not None:
            unbiased = m2 / (total - 1).clamp_min(1)
            updated = running_var * (1 - factor) + unbiased.to(running_var.dtype) * factor
            running_var.copy_(torch.where(seen, updated, running_var))
        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight.to(acc)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group = group
        # (x − mean)·scale + bias: the deviation first, so a large mean cancels exactly here
        # instead of in x·scale − mean·scale (two large numbers, as a fused kernel computes it).
        out = (xa - _per_channel(mean, ndim)).mul_(_per_channel(scale, ndim))
        if bias is not None:
            out.add_(_per_channel(bias.to(acc), ndim))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd, total = ctx.saved_tensors
        channels, ndim = x.shape[1], x.dim()
        dims = [0, *range(2, ndim)]
        acc = mean.dtype
        dy = grad_output.to(acc)
        xmu = x.to(acc) - _per_channel(mean, ndim)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = _allreduce(torch.cat([sum_dy, sum_dy_xmu]), ctx.group)
            n = total.clamp_min(1)
            mean_dy, mean_dy_xmu = both[:channels] / n, both[channels:] / n
            scale = invstd if weight is None else invstd * weight.to(acc)
            # dx = (dy − mean(dy) − x̂·mean(dy·x̂))·invstd·weight, with x̂ = (x − mean)·invstd.
            grad_input = xmu.mul_(_per_channel(-mean_dy_xmu * invstd.square(), ndim))
            grad_input.add_(dy).sub_(_per_channel(mean_dy, ndim)).mul_(_per_channel(scale, ndim))
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole group's batch; any input of 2 or more dims (N, C, ...).

    Args:
        num_features: C, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: the running statistics' update factor (None: a cumulative moving average).
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance for evaluation.
        group: the ranks whose batches are normalised together (default: the world).
        device: where the parameters and buffers are made.
        dtype: their dtype.

    Raises:
        ValueError: (in forward) an input of fewer than 2 dims.
        RuntimeError: (in forward) a training forward inside `td.join(...)`, where a rank out of
            batches cannot answer the statistics all-reduce.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group: Group | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not bn_training or not runtime.is_initialized() or group_size(self.group) == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        if join_active():
            raise RuntimeError(
                "SyncBatchNorm cannot synchronise inside td.join(): a rank that has run out of "
                "batches cannot answer its statistics all-reduce. Use BatchNorm (per-rank "
                "statistics) with join, or give every rank the same number of batches."
            )
        group = self.group if self.group is not None else _private_world_group()
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group)

    @classmethod
    def convert(cls, module: nn.Module, group: Group | None = None) -> nn.Module:
        """Return `module` with every BatchNorm*d replaced by a SyncBatchNorm sharing its
        parameters and buffers (like torch's `convert_sync_batchnorm`). Call it on every rank."""
        if group is None and runtime.is_initialized() and runtime.size() > 1:
            _private_world_group()
        return cls._convert(module, group)

    @classmethod
    def _convert(cls, module: nn.Module, group: Group | None) -> nn.Module:
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group=group)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls._convert(child, group))
        return converted
