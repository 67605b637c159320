"""Self-attention with its heads split across a tensor-parallel group.

Each rank computes `num_heads / tp` whole heads: its slices of the query, key and value
projections (column-parallel: no communication), attention on those heads alone, and its slice
of the output projection's input columns (row-parallel: one all-reduce). Built from an
`nn.MultiheadAttention` (`from_multihead`), it keeps that module's call signature for
self-attention, so a model that calls `self.attn(x, x, x, need_weights=False)` runs unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size
from tandem.parallel.layout import state_hooks
from tandem.parallel.layout.pieces import Chunk, Held, Placement, sliced, whole
from tandem.parallel.tensor.layers import gather_rows, mark_sliced, shard_range
from tandem.parallel.tensor.regions import copy_to, reduce_from


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention, `num_heads / tp` heads on each rank of `group`."""

    @classmethod
    def from_multihead(cls, mha: nn.MultiheadAttention, *,
                       group: Group | None = None) -> ParallelSelfAttention:
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("ParallelSelfAttention converts nn.MultiheadAttention with equal "
                             "query/key/value sizes, no bias_k/bias_v and add_zero_attn=False")
        layer = cls()
        layer.embed_dim, layer.num_heads, layer.group = mha.embed_dim, mha.num_heads, group
        layer.batch_first, layer.dropout = mha.batch_first, mha.dropout
        head_dim = mha.embed_dim // mha.num_heads
        first, last = shard_range(mha.num_heads, group, "num_heads")
        layer.local_heads, layer.head_dim = last - first, head_dim
        rows = slice(first * head_dim, last * head_dim)
        e = mha.embed_dim
        w = mha.in_proj_weight.detach()
        # q, k and v are stacked in in_proj_weight; this rank keeps its heads' rows of each.
        layer.in_proj_weight = nn.Parameter(torch.cat(
            [w[i * e:(i + 1) * e][rows] for i in range(3)]).clone())
        b = mha.in_proj_bias
        layer.in_proj_bias = None if b is None else nn.Parameter(torch.cat(
            [b.detach()[i * e:(i + 1) * e][rows] for i in range(3)]).clone())
        layer.out_weight = nn.Parameter(mha.out_proj.weight.detach()[:, rows].clone())
        out_bias = mha.out_proj.bias
        layer.out_bias = None if out_bias is None else nn.Parameter(out_bias.detach().clone())
        mark_sliced(group, layer.in_proj_weight, layer.in_proj_bias, layer.out_weight)
        state_hooks.install(layer)
        return layer

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, need_weights: bool = False,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                key_padding_mask: torch.Tensor | None = None, average_attn_weights: bool = True):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("ParallelSelfAttention is self-attention: pass the same tensor as "
                             "query, key and value")
        if need_weights or key_padding_mask is not None:
            raise ValueError("ParallelSelfAttention returns no attention weights and takes no "
                             "key_padding_mask (use attn_mask); call it with need_weights=False")
        x = query if self.batch_first else query.transpose(0, 1)  # (batch, seq, embed)
        batch, seq, _ = x.shape
        qkv = F.linear(copy_to(x, self.group), self.in_proj_weight, self.in_proj_bias)
        q, k, v = (t.reshape(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        dropout = self.dropout if self.training else 0.0
        mask = None if is_causal else self._local_mask(attn_mask, batch, q.dtype)
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                               is_causal=is_causal)
        merged = heads.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim)
        out = reduce_from(F.linear(merged, self.out_weight), self.group)
        if self.out_bias is not None:
            out = out + self.out_bias
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _local_mask(self, attn_mask: torch.Tensor | None, batch: int,
                    dtype: torch.dtype) -> torch.Tensor | None:
        """`attn_mask` as nn.MultiheadAttention reads it, made SDPA's for this rank's heads.

        nn.MultiheadAttention's boolean mask marks the positions *not* attended (SDPA's marks
        those attended): passed through as is, it would silently attend to the wrong ones. A
        3-D mask holds one (L, S) mask per batch row and head, of which this rank keeps its own
        heads. `is_causal=True` is, as for nn.MultiheadAttention, a hint that the mask given is
        the causal one, and the caller skips the mask then (SDPA refuses both on CUDA).
        """
        if attn_mask is None:
            return None
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device
                                    ).masked_fill_(attn_mask, float("-inf"))
        if attn_mask.dim() == 3:
            first, _ = shard_range(self.num_heads, self.group, "num_heads")
            per_head = attn_mask.reshape(batch, self.num_heads, *attn_mask.shape[1:])
            attn_mask = per_head[:, first:first + self.local_heads]
        return attn_mask

    def local_pieces(self, prefix: str) -> list[Held]:
        """nn.MultiheadAttention's names; in_proj holds this rank's rows of q, k and v, stacked
        (three boxes of one local tensor, `parallel/layout/pieces.py`)."""
        e, part = self.embed_dim, self.local_heads * self.head_dim
        first = part * group_rank(self.group)

        def stacked(name: str, local: torch.Tensor) -> Held:
            inner = math.prod(local.shape[1:])
            chunks = tuple(Chunk((i * e + first, *(0,) * (local.dim() - 1)), (part, *local.shape[1:]),
                                 i * part * inner) for i in range(3))
            return Held(local, (Placement(prefix + name, (3 * e, *local.shape[1:]), chunks),))

        out = [stacked("in_proj_weight", self.in_proj_weight)]
        if self.in_proj_bias is not None:
            out.append(stacked("in_proj_bias", self.in_proj_bias))
        out.append(Held(self.out_weight, (sliced(prefix + "out_proj.weight", self.out_weight, (e, e),
                                                 first, dim=1),)))
        if self.out_bias is not None:
            out.append(Held(self.out_bias, (whole(prefix + "out_proj.bias", self.out_bias),)))
        return out

    def full_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + name: value for name, value in self.full_weights().items()}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """`nn.MultiheadAttention`'s state (in_proj_weight, ..., out_proj.bias), gathered."""
        tp, e = group_size(self.group), self.embed_dim
        part = self.local_heads * self.head_dim

        def stacked(tensor: torch.Tensor) -> torch.Tensor:
            # Gathered rank by rank: [q0 k0 v0 q1 k1 v1 ...]; regroup into [q; k; v].
            every = gather_rows(tensor, self.group).reshape(tp, 3, part, *tensor.shape[1:])
            return every.transpose(0, 1).reshape(3 * e, *tensor.shape[1:])

        full = {"in_proj_weight": stacked(self.in_proj_weight),
                "out_proj.weight": gather_rows(self.out_weight.t(), self.group).t().contiguous()}
        if self.in_proj_bias is not None:
            full["in_proj_bias"] = stacked(self.in_proj_bias)
        if self.out_bias is not None:
            full["out_proj.bias"] = self.out_bias.detach().clone()
        return full

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads} "
                f"(this rank: {self.local_heads})")
