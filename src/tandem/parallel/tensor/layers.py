"""Tensor-parallel layers: each rank of a group holds a slice of a layer's weight.

Built from an existing full layer (`from_full`) so that a model made the same way on every rank
(same seed) becomes its tensor-parallel version without rewriting it; `parallelize` in plan.py
does this by layer name. Slices are contiguous and equal: sizes must be divisible by tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.comm.groups import Group, group_rank, group_size
from tandem.parallel.tensor import regions


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(size: int, tp: int, what: str) -> int:
    """`size // tp`, or a ValueError naming the size, tp and the nearest valid choices."""
    if size % tp == 0:
        return size // tp
    below, above = size - size % tp, size + tp - size % tp
    valid_tp = [d for d in _divisors(size) if d > 1]
    near = sorted(valid_tp, key=lambda d: abs(d - tp))[:3]
    raise ValueError(
        f"{what} = {size} is not divisible by tp = {tp}: make it {below or above} or {above}, "
        f"or use tp in {sorted(near) or [1]} (the divisors of {size} nearest {tp})"
    )


def _shard(tensor: torch.Tensor, dim: int, group: Group | None) -> nn.Parameter:
    piece = tensor.detach().chunk(group_size(group), dim=dim)[group_rank(group)]
    return nn.Parameter(piece.clone(), requires_grad=tensor.requires_grad)


class ColumnParallelLinear(nn.Module):
    """`y = x Aᵀ + b` with A split by output features (rows of A): each rank makes a slice of y.

    The input is replicated; its gradient is summed over the group (`copy_to_group`). With
    `gather_output=False` (the default) the output stays split, ready for a `RowParallelLinear`.
    """

    tp_dim = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Group | None = None, gather_output: bool = False, **factory) -> None:
        super().__init__()
        tp = group_size(group)
        local = check_divisible(out_features, tp, "out_features")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(local, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(local, **factory)) if bias else None
        self._full_init()

    def _full_init(self) -> None:
        full = nn.Linear(self.in_features, self.out_features, self.bias is not None)
        self._take(full)

    def _take(self, full: nn.Linear) -> None:
        dim = self.tp_dim
        self.weight = _shard(full.weight, dim["weight"], self.group)
        if self.bias is not None:
            self.bias = _shard(full.bias, dim["bias"], self.group)

    @classmethod
    def from_full(cls, full: nn.Linear, group: Group | None = None, **options):
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        tp = group_size(group)
        check_divisible(full.out_features if cls.tp_dim["weight"] == 0 else full.in_features,
                        tp, "out_features" if cls.tp_dim["weight"] == 0 else "in_features")
        layer.in_features, layer.out_features, layer.group = full.in_features, full.out_features, group
        layer.bias = None if full.bias is None else full.bias
        layer._options(**options)
        layer._take(full)
        return layer

    def _options(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output from an input already in the region (no communication)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(regions.copy_to_group(x, self.group))
        return regions.gather_from_group(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} split over {group_size(self.group)}"


class RowParallelLinear(ColumnParallelLinear):
    """`y = x Aᵀ + b` with A split by input features: each rank multiplies its slice of x.

    The partial products are summed over the group (`reduce_from_group`) and the replicated bias
    added once. With `input_is_parallel=False` a replicated input is sliced first.
    """

    tp_dim = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Group | None = None, input_is_parallel: bool = True, **factory) -> None:
        nn.Module.__init__(self)
        local = check_divisible(in_features, group_size(group), "in_features")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, local, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self._full_init()

    def _take(self, full: nn.Linear) -> None:
        self.weight = _shard(full.weight, 1, self.group)
        if self.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())

    def _options(self, input_is_parallel: bool = True) -> None:
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = regions.scatter_to_group(x, self.group)
        y = regions.reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group.

    Each rank looks up the ids in its range, zeros the rest, and the rows are summed over the
    group: one all-reduce forward, none backward.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group | None = None) -> None:
        super().__init__()
        self._setup(nn.Embedding(num_embeddings, embedding_dim), group)

    @classmethod
    def from_full(cls, full: nn.Embedding, group: Group | None = None):
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(full, group)
        return layer

    def _setup(self, full: nn.Embedding, group: Group | None) -> None:
        local = check_divisible(full.num_embeddings, group_size(group), "num_embeddings (vocabulary)")
        self.num_embeddings, self.embedding_dim, self.group = full.num_embeddings, full.embedding_dim, group
        self.start = group_rank(group) * local
        self.end = self.start + local
        self.weight = _shard(full.weight, 0, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return regions.reduce_from_group(rows, self.group)


class ParallelAttention(nn.Module):
    """Multi-head self-attention with the heads split over the group.

    q, k, v are column-parallel (each rank computes `heads / tp` whole heads), the output
    projection is row-parallel: one all-reduce forward and one backward, as in an MLP.
    """

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, out: nn.Linear, num_heads: int,
                 group: Group | None = None, causal: bool = False) -> None:
        super().__init__()
        tp = group_size(group)
        self.local_heads = check_divisible(num_heads, tp, "num_heads")
        self.num_heads, self.group, self.causal = num_heads, group, causal
        self.q, self.k, self.v = (ColumnParallelLinear.from_full(m, group) for m in (q, k, v))
        self.out = RowParallelLinear.from_full(out, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        x = regions.copy_to_group(x, self.group)  # one gradient all-reduce for q, k and v together

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.local_heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q.local(x)), heads(self.k.local(x)),
                                           heads(self.v.local(x)),
                                           is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))
