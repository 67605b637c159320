"""Layers split across the ranks of a tensor-parallel group (Megatron-LM's layout).

- `ColumnParallelLinear`: each rank holds a slice of the *output* features. Its output stays
  split (feed it to a `RowParallelLinear`), or is gathered with `gather_output=True`.
- `RowParallelLinear`: each rank holds a slice of the *input* features and computes a partial
  product; one all-reduce sums them. Column then row: one all-reduce forward, one backward.
- `VocabParallelEmbedding`: each rank holds a slice of the vocabulary's rows.
- `vocab_parallel_cross_entropy`: the loss over logits split along the vocabulary, without
  ever gathering them (a max, then the sum of exponentials and the target's logit: two
  all-reduces of one and two numbers per token, straight to the engine after one check of the
  call when no model's agreement covers it).

Every layer is built from the full layer (`from_linear`, `from_embedding`) so that its shards
are slices of the one-process weights, or from sizes, with the one-process initialisation
sliced on every rank (same seed, same full tensor). `group=None` is the whole world.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.comm.agreement import checks
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size
from tandem.parallel.layout import split_grads, splits, state_hooks
from tandem.parallel.layout.pieces import Held, sliced, whole
from tandem.parallel.tensor import guard, region_ops
from tandem.parallel.tensor.regions import copy_to, gather_from, reduce_from, scatter_to


def shard_range(size: int, group: Group | None, what: str) -> tuple[int, int]:
    """[start, end) of this rank's equal slice of `size`; an error naming valid choices if uneven."""
    tp = group_size(group)
    if size % tp:
        divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 2 * tp + 8]
        below, above = size - size % tp, size - size % tp + tp
        raise ValueError(
            f"{what} = {size} is not divisible by tp = {tp}: choose tp in {divisors} or make "
            f"{what} a multiple of {tp} (e.g. {below or above} or {above})"
        )
    part = size // tp
    return group_rank(group) * part, (group_rank(group) + 1) * part


def mark_sliced(group: Group | None, *params: torch.Tensor | None) -> None:
    """Register the tensors as tensor-parallel slices over `group` (see `parallel/layout/splits.py`),
    and the group for the regions' compiled operators (`region_ops.remember`)."""
    region_ops.remember(group)
    for param in params:
        if param is not None:
            splits.mark(param, splits.TENSOR_PARALLEL, group)
            split_grads.mark_grads(param)


def _slice(tensor: torch.Tensor | None, dim: int, bounds: tuple[int, int]) -> nn.Parameter | None:
    if tensor is None:
        return None
    start, end = bounds
    return nn.Parameter(tensor.detach().narrow(dim, start, end - start).clone())


class ColumnParallelLinear(nn.Module):
    """`y = x Wᵀ + b` with W's rows (output features) split over the group.

    Every rank of the group builds it from the same seed: each keeps its rows of the one
    `nn.Linear` it makes (`from_linear` takes an existing one).

    Args:
        in_features: the input features (whole on every rank).
        out_features: the output features, split over the group (divisible by its size).
        bias: learn a bias (split like the rows).
        gather_output: all-gather the output's features, so that every rank gets the whole
            output; False (the default) leaves this rank's part for a `RowParallelLinear`.
        group: the tensor-parallel group (`mesh.tp_group`; default: the world).
        device: where the weights are made.
        dtype: their dtype.

    Raises:
        ValueError: `out_features` is not divisible by the group's size (the message names the
            sizes that divide it).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, group: Group | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._take(full, gather_output, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, gather_output: bool = False,
                    group: Group | None = None) -> ColumnParallelLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(linear, gather_output, group)
        return layer

    def _take(self, full: nn.Linear, gather_output: bool, group: Group | None) -> None:
        self.in_features, self.out_features = full.in_features, full.out_features
        self.gather_output, self.group = gather_output, group
        bounds = shard_range(full.out_features, group, "out_features")
        self.weight = _slice(full.weight, 0, bounds)
        self.bias = _slice(full.bias, 0, bounds)
        mark_sliced(group, self.weight, self.bias)
        state_hooks.install(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to(x, self.group), self.weight, self.bias)
        return gather_from(y, self.group) if self.gather_output else y

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The one-process `weight` and `bias`, gathered (for a consolidated checkpoint)."""
        return {name: gather_rows(p, self.group) for name, p in self.named_parameters()}

    def local_pieces(self, prefix: str) -> list[Held]:
        """Rows of the one-process weight and bias (the layout protocol, `parallel/layout/pieces.py`)."""
        first = self.weight.shape[0] * group_rank(self.group)
        out = [Held(self.weight, (sliced(prefix + "weight", self.weight,
                                         (self.out_features, self.in_features), first),))]
        if self.bias is not None:
            out.append(Held(self.bias, (sliced(prefix + "bias", self.bias, (self.out_features,), first),)))
        return out

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + name: value for name, value in self.full_weights().items()}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """`y = x Wᵀ + b` with W's columns (input features) split over the group; `b` is whole.

    Args:
        in_features: the input features, split over the group (divisible by its size).
        out_features: the output features (whole on every rank; the partial products are
            all-reduced).
        bias: learn a bias (whole, added after the all-reduce).
        input_is_parallel: the input is already split along its features (a
            `ColumnParallelLinear`'s output); False scatters a whole input first.
        group: the tensor-parallel group (`mesh.tp_group`; default: the world).
        device: where the weights are made.
        dtype: their dtype.

    Raises:
        ValueError: `in_features` is not divisible by the group's size; in forward, an input
            whose features are not this rank's part (put a colwise layer before it, or build it
            with input_is_parallel=False).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, group: Group | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._take(full, input_is_parallel, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, input_is_parallel: bool = True,
                    group: Group | None = None) -> RowParallelLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(linear, input_is_parallel, group)
        return layer

    def _take(self, full: nn.Linear, input_is_parallel: bool, group: Group | None) -> None:
        self.in_features, self.out_features = full.in_features, full.out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.weight = _slice(full.weight, 1, shard_range(full.in_features, group, "in_features"))
        mark_sliced(group, self.weight)
        state_hooks.install(self)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.group)
        elif x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"RowParallelLinear (in_features={self.in_features}, {self.weight.shape[1]} on "
                f"this rank) got inputs of {x.shape[-1]} features: a rowwise layer reads the split "
                f"output of its 'colwise' partner; put a colwise layer before it, or build it with "
                f"input_is_parallel=False to take a whole input")
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def full_weights(self) -> dict[str, torch.Tensor]:
        full = {"weight": gather_rows(self.weight.t(), self.group).t().contiguous()}
        if self.bias is not None:
            full["bias"] = self.bias.detach().clone()
        return full

    def local_pieces(self, prefix: str) -> list[Held]:
        """Columns of the one-process weight; the bias whole (`parallel/layout/pieces.py`)."""
        first = self.weight.shape[1] * group_rank(self.group)
        out = [Held(self.weight, (sliced(prefix + "weight", self.weight,
                                         (self.out_features, self.in_features), first, dim=1),))]
        if self.bias is not None:
            out.append(Held(self.bias, (whole(prefix + "bias", self.bias),)))
        return out

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + name: value for name, value in self.full_weights().items()}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group.

    Args:
        num_embeddings: the vocabulary size, split over the group (divisible by its size).
        embedding_dim: the size of each embedding vector (whole on every rank).
        group: the tensor-parallel group (`mesh.tp_group`; default: the world).
        device: where the weight is made.
        dtype: its dtype.

    Raises:
        ValueError: `num_embeddings` is not divisible by the group's size; `from_embedding` of
            an embedding with padding_idx, max_norm or sparse gradients.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        self._take(nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype), group)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *,
                       group: Group | None = None) -> VocabParallelEmbedding:
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings: no padding_idx, "
                             "max_norm or sparse gradients (sparse=True, what SparseAdam steps: "
                             "build it with sparse=False and a dense optimizer such as AdamW, or "
                             "keep SparseAdam with the embedding whole on every rank: "
                             "tandem.horovod's hvd.DistributedOptimizer averages sparse gradients)")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(embedding, group)
        return layer

    def _take(self, full: nn.Embedding, group: Group | None) -> None:
        self.num_embeddings, self.embedding_dim, self.group = (
            full.num_embeddings, full.embedding_dim, group)
        self.start, self.end = shard_range(full.num_embeddings, group, "num_embeddings")
        self.weight = _slice(full.weight, 0, (self.start, self.end))
        mark_sliced(group, self.weight)
        state_hooks.install(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(rows, self.group)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return {"weight": gather_rows(self.weight, self.group)}

    def local_pieces(self, prefix: str) -> list[Held]:
        """Rows (vocabulary entries) of the one-process weight (`parallel/layout/pieces.py`)."""
        full = (self.num_embeddings, self.embedding_dim)
        return [Held(self.weight, (sliced(prefix + "weight", self.weight, full, self.start),))]

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + name: value for name, value in self.full_weights().items()}


def gather_rows(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    data = tensor.detach().contiguous()
    return collectives.allgather(data, group=group) if group_size(group) > 1 else data.clone()


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Group | None = None) -> torch.Tensor:
    """Mean cross-entropy of `logits` split along the last (vocabulary) dimension.

    `logits` is (..., vocab / tp) on each rank, as a `ColumnParallelLinear` head gives it;
    `target` holds global class indices. Equals `F.cross_entropy` of the gathered logits.

    Args:
        logits: this rank's part of the logits, (..., vocab / tp); half precision is computed
            in float32.
        target: the class indices (global, 0 to vocab - 1), of the logits' shape without the
            last dim; the same on every rank.
        group: the tensor-parallel group the vocabulary is split over (default: the world).

    Returns:
        The mean cross-entropy over the tokens (a 0-d tensor, the same on every rank).

    Raises:
        CollectiveMismatchError: the ranks passed logits of other shapes or dtypes (each
            rank's named).
    """
    if group_size(group) > 1 and guard.ensure(group):
        # Outside a covered forward (the usual place of a loss): one check of the whole call,
        # then its two all-reduces go straight to the engine.
        checks.agree("vocab_parallel_cross_entropy", logits, group)
    per_token = _VocabParallelCrossEntropy.apply(logits, target, group)
    return per_token.mean()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        part = logits.shape[-1]
        start = group_rank(group) * part
        # Half-precision logits: the softmax is computed in float32 (exp and the sums over a
        # vocabulary lose too much in 16 bits); the gradient is returned in the logits' dtype.
        ctx.dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        # Stable softmax: subtract the global maximum (no gradient flows through it).
        top = logits.detach().amax(dim=-1)
        if group_size(group) > 1:
            top = direct.allreduce(top, "max", group, inplace=True)
        shifted = logits - top.unsqueeze(-1)
        mine = (target >= start) & (target < start + part)
        local = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), picked])
        if group_size(group) > 1:
            sums = direct.allreduce(sums, "sum", group, inplace=True)
        total, target_logit = sums[0], sums[1]
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        result = softmax.clone()
        onehot = torch.zeros_like(result).scatter_(-1, local.unsqueeze(-1), 1.0)
        result -= onehot * mine.unsqueeze(-1)
        return (result * grad.unsqueeze(-1)).to(ctx.dtype), None, None
