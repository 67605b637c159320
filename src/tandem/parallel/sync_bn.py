"""`SyncBatchNorm`: batch statistics over every rank of the group, not just this rank's batch.

    model = td.SyncBatchNorm.convert(model)   # every BatchNorm*d becomes a SyncBatchNorm

With small per-rank batches, BatchNorm's per-rank statistics are noisy and differ from what
one process with the whole batch computes. In training, this module:

- forward: all-reduces [sum(x), sum(x²), count] per channel (one message of 2C+1 numbers),
  normalises with the global mean and (biased) variance, and updates the running statistics
  with the global mean and unbiased variance, so they stay equal on every rank;
- backward: all-reduces [sum(dy), sum(dy·(x−mean))] per channel (2C numbers), which is what
  the input gradient needs from the other ranks' samples. The weight and bias gradients stay
  local: the gradient reducer averages them like any other parameter's.

Together, k ranks with batch B/k give the output, gradients and running statistics of one
process with batch B. The sums are accumulated in float32 at least; the variance comes from
E[x²] − E[x]², which loses precision only when |mean| is much larger than the std (BatchNorm
inputs rarely are). Eval mode uses the running statistics and communicates nothing; so does a
world of one.

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
from tandem.comm.groups import Group, group_size, new_group
from tandem.parallel.join import join_active

_private: list = []  # [(weakref to the RuntimeState it belongs to, Group)]


def _private_world_group() -> Group:
    state = runtime.state()
    if _private and _private[0][0]() is state:
        return _private[0][1]
    group = new_group(range(runtime.size()))  # collective: every rank gets here together
    _private[:] = [(weakref.ref(state), group)]
    return group


def _allreduce(tensor: torch.Tensor, group: Group | None) -> None:
    runtime.get_backend().allreduce(tensor, "sum", group).wait(runtime.state().timeout)


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xa = x.to(acc)
        stats = torch.empty(2 * channels + 1, dtype=acc, device=x.device)
        torch.sum(xa, dim=dims, out=stats[:channels])
        torch.sum(xa.square(), dim=dims, out=stats[channels : 2 * channels])
        stats[2 * channels] = x.numel() // max(channels, 1)
        _allreduce(stats, group)
        count = stats[2 * channels]
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean.square()).clamp_min_(0)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        if running_var is not None:
            unbiased = var * (count / (count - 1).clamp_min(1))
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        # The affine normalisation with the global statistics, in one fused kernel.
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd, count = ctx.saved_tensors
        channels, ndim = x.shape[1], x.dim()
        dims = [0, *range(2, ndim)]
        acc = mean.dtype
        dy = grad_output.to(acc)
        xa = x.to(acc)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xa).sum(dims) - mean * sum_dy
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu])
            _allreduce(both, ctx.group)
            total_dy, total_dy_xmu = both[:channels], both[channels:]
            a = invstd if weight is None else invstd * weight.to(acc)
            b = -a * invstd.square() * total_dy_xmu / count
            c = -a * total_dy / count - b * mean
            # dx = a·dy + b·x + c per channel: dy minus its mean and its projection on x̂.
            grad_input = torch.addcmul(_per_channel(c, ndim), dy, _per_channel(a, ndim))
            grad_input.addcmul_(xa, _per_channel(b, ndim))
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole group's batch; any input of 2 or more dims (N, C, ...)."""

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
