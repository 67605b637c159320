"""Where each token of a sequence lives: the head-tail split of both forms, and the one call
that splits a batch's inputs, positions and labels the same way.

The sequence of length T is cut into 2*sp chunks of T/(2*sp) tokens; rank i keeps chunk i and
chunk 2*sp-1-i, in that order. Under a causal mask the early tokens see few keys and the late
ones many: a plain split (rank i keeps chunk i) would give the last rank almost all the work,
while one early and one late chunk give every rank the same amount (Megatron's and torch's
load balancing). The ring form relies on it to skip the blocks a causal mask hides; the
all-to-all form puts the gathered sequence back in order around attention. Both forms use
this one layout, so a batch split once runs under either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.comm.collectives import user as collectives
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_size


class SequenceSplitError(ValueError):
    """A sequence the split cannot take (a length that does not divide), or a tensor without
    the dimension named."""


def chunk_order(sp: int) -> list[int]:
    """The chunks in the order the ranks hold them: [0, 2sp-1, 1, 2sp-2, ...]."""
    return [c for i in range(sp) for c in (i, 2 * sp - 1 - i)]


def positions_of(rank: int, sp: int, length: int, device=None) -> torch.Tensor:
    """The global positions (0..length-1) of the tokens `rank` holds, in its order."""
    c = length // (2 * sp)
    first, second = rank, 2 * sp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def gathered_positions(sp: int, length: int, device=None) -> torch.Tensor:
    """The global position of each token of the rank-by-rank concatenation of every rank's part."""
    return torch.cat([positions_of(r, sp, length, device) for r in range(sp)])


def check_length(length: int, sp: int, what: str) -> None:
    if length % (2 * sp):
        fit = -(-length // (2 * sp)) * 2 * sp
        raise SequenceSplitError(
            f"{what}: a sequence of {length} tokens cannot be split over a context-parallel "
            f"group of {sp} ranks: it is cut into 2 * sp = {2 * sp} equal chunks (one early and "
            f"one late chunk per rank, so that a causal mask gives every rank the same work), "
            f"so its length must be a multiple of {2 * sp}. Pad the batch to {fit} tokens "
            f"(inputs with any token, labels with the loss's ignore_index, e.g. -100, under a "
            f"causal mask, whose real tokens never see the padding at the end), or choose a "
            f"length or a group size that divides.")


def _dims(seq_dim: int | Sequence[int], count: int) -> list[int]:
    if isinstance(seq_dim, int):
        return [seq_dim] * count
    dims = list(seq_dim)
    if len(dims) != count:
        raise ValueError(f"split got {count} tensors but {len(dims)} seq_dims ({dims}): give one "
                         "per tensor, or one int for all")
    return dims


def split(*tensors: torch.Tensor, seq_dim: int | Sequence[int] = 1,
          group: Group | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """This rank's part of each tensor's sequence (the head-tail split), every tensor alike.

    Split the inputs, the positions and the labels of a batch with one call, so that token,
    position and label stay together. A model whose positions come from the local length
    (`torch.arange(x.shape[1])`) would number every rank's tokens from 0: pass the positions in
    and split them here.

    Args:
        tensors: whole sequences (every rank of the group passes the same ones).
        seq_dim: the sequence dimension: one for all tensors, or one per tensor.
        group: the context-parallel group (`mesh.cp_group`; None: the world).

    Returns:
        The parts, in the order given (one tensor for one tensor).

    Raises:
        SequenceSplitError: a length that is not a multiple of 2 * the group's size, or
            tensors whose sequence lengths differ.
    """
    sp = group_size(group)
    dims = _dims(seq_dim, len(tensors))
    lengths = {t.shape[d] for t, d in zip(tensors, dims, strict=True)}
    if len(lengths) > 1:
        shapes = ", ".join(f"{tuple(t.shape)} (dim {d})" for t, d in zip(tensors, dims, strict=True))
        raise SequenceSplitError(f"td.context.split: the tensors have sequences of different "
                                 f"lengths: {shapes}; pass tensors of one sequence, with the "
                                 f"dimension that holds it (seq_dim=[...], one per tensor)")
    out = []
    for t, d in zip(tensors, dims, strict=True):
        check_length(t.shape[d], sp, "td.context.split")
        c = t.shape[d] // (2 * sp)
        r = group_rank(group)
        out.append(torch.cat([t.narrow(d, r * c, c), t.narrow(d, (2 * sp - 1 - r) * c, c)], d))
    return out[0] if len(out) == 1 else tuple(out)


def gather(tensor: torch.Tensor, seq_dim: int = 1, group: Group | None = None) -> torch.Tensor:
    """The whole sequence, in order, from every rank's part (`split`'s inverse; no gradient).

    Every rank of the group calls it; each gets the whole tensor (an all-gather).

    Args:
        tensor: this rank's part, as `split` gave it (or a model's output on it).
        seq_dim: the sequence dimension.
        group: the context-parallel group (`mesh.cp_group`; None: the world).

    Returns:
        The whole tensor, its sequence in the original order, on every rank (`tensor` itself in
        a group of one).

    Raises:
        CollectiveMismatchError: the ranks passed parts of other shapes or dtypes (each rank's
            named).
    """
    sp = group_size(group)
    if sp == 1:
        return tensor
    moved = tensor.movedim(seq_dim, 0).contiguous()
    every = collectives.allgather(moved, group=group)
    order = torch.argsort(gathered_positions(sp, every.shape[0], every.device))
    return every.index_select(0, order).movedim(0, seq_dim)
