"""Which gradients travel together: the pure bucket-assignment policy of the reducer.

Reducing every gradient on its own costs one message per parameter (latency dominates);
reducing them all at once waits for the whole backward pass (no overlap). Buckets are the
middle: gradients are grouped, in the order backward is expected to produce them, into flat
buffers of about `cap_bytes`, and each bucket is reduced as soon as its last gradient is
ready. The first bucket gets a smaller cap (`first_cap_bytes`, PyTorch DDP's 1 MiB) so that
communication starts early in the backward pass instead of after 25 MB of gradients.

Rules (those of DDP's `compute_bucket_assignment_by_size`):
- a bucket never mixes dtypes or devices: one flat buffer per bucket, reduced by one call;
- a parameter is added to the open bucket of its kind, which is closed once it reaches its cap,
  so a bucket exceeds its cap by at most one parameter, and a parameter bigger than the cap
  gets a bucket of its own;
- each parameter starts at an offset aligned to `align_bytes`, so vectorised kernels on the
  per-parameter views run on aligned memory (the padding stays zero and costs a few bytes);
- buckets are ordered by when they are expected to complete (the position of their last
  parameter), which is the order the reducer launches them in;
- optionally (`last_cap_bytes`; the reducer uses the first bucket's cap) the last bucket is
  small too. Its reduction starts only when backward has finished, so nothing hides it; DDP's
  layout puts up to 25 MB there (ResNet-9: 16 MB), tandem's about 1 MB, and the large bucket
  before it is reduced while the first layers' gradients are still being computed.

Everything here is a pure function of the parameter list, so every rank computes the same
layout from the same model, and the layout is unit-tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_CAP_BYTES = 25 << 20
DEFAULT_FIRST_CAP_BYTES = 1 << 20
DEFAULT_ALIGN_BYTES = 64


@dataclass(frozen=True)
class ParamInfo:
    """What bucketing needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> ParamInfo:
        return cls(name, tuple(tensor.shape), tensor.dtype, str(tensor.device))


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: `params` (indices into the input list) start at `offsets` (elements)."""

    index: int
    dtype: torch.dtype
    device: str
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int  # elements of the gradient region, padding included

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _aligned(offset: int, align: int) -> int:
    return (offset + align - 1) // align * align


def _kind(info: ParamInfo) -> tuple[torch.dtype, str]:
    return (info.dtype, info.device)


def _split(params: Sequence[ParamInfo], indices: Sequence[int], first_cap: int, cap: int) -> list[list[int]]:
    """DDP's rule over `indices` (in order): per kind, close a bucket once it reaches its cap."""
    open_: dict[tuple[torch.dtype, str], tuple[list[int], list[int]]] = {}  # members, [bytes]
    closed: dict[tuple[torch.dtype, str], int] = {}
    groups: list[list[int]] = []
    for i in indices:
        kind = _kind(params[i])
        members, size = open_.setdefault(kind, ([], [0]))
        members.append(i)
        size[0] += params[i].nbytes
        if size[0] >= (first_cap if closed.get(kind, 0) == 0 else cap):
            groups.append(members)
            closed[kind] = closed.get(kind, 0) + 1
            del open_[kind]
    return groups + [members for members, _ in open_.values()]


def _tail(params: Sequence[ParamInfo], last_cap: int) -> dict[tuple[torch.dtype, str], list[int]]:
    """Per kind, the last parameters to become ready, up to `last_cap` bytes (in order)."""
    tails: dict[tuple[torch.dtype, str], list[int]] = {}
    sizes: dict[tuple[torch.dtype, str], int] = {}
    for i in reversed(range(len(params))):
        kind = _kind(params[i])
        if sizes.get(kind, 0) >= last_cap:
            continue
        tails.setdefault(kind, []).insert(0, i)
        sizes[kind] = sizes.get(kind, 0) + params[i].nbytes
    return tails


def assign_buckets(
    params: Sequence[ParamInfo],
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int | None = DEFAULT_FIRST_CAP_BYTES,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    last_cap_bytes: int | None = None,
) -> list[Bucket]:
    """Group `params` (in expected gradient-ready order) into buckets; see the module docstring.

    `first_cap_bytes` applies to the first bucket of each dtype/device (None: same as
    `cap_bytes`). `last_cap_bytes` (None: off, DDP's layout) also makes the *last* bucket of
    each kind small: its reduction cannot overlap any backward compute, so the less it holds,
    the less communication is left exposed at the end of backward.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    if first_cap_bytes is None:
        first_cap_bytes = cap_bytes
    if first_cap_bytes <= 0:
        raise ValueError(f"first_cap_bytes must be positive (or None), got {first_cap_bytes}")
    if last_cap_bytes is not None and last_cap_bytes <= 0:
        raise ValueError(f"last_cap_bytes must be positive (or None), got {last_cap_bytes}")
    if align_bytes <= 0:
        raise ValueError(f"align_bytes must be positive, got {align_bytes}")

    tails = _tail(params, last_cap_bytes) if last_cap_bytes is not None else {}
    reserved = {i for members in tails.values() for i in members}
    groups = _split(params, [i for i in range(len(params)) if i not in reserved], first_cap_bytes, cap_bytes)
    for kind, tail in tails.items():
        # The main split's last bucket of this kind, when smaller than the tail's cap, joins the
        # tail instead of travelling as one more small message.
        last = max((g for g in groups if _kind(params[g[0]]) == kind), key=lambda g: g[-1], default=None)
        if last is not None and sum(params[i].nbytes for i in last) < last_cap_bytes:
            groups.remove(last)
            tail[:0] = last
        groups.append(tail)
    # Launch order = completion order: a bucket is complete when its last parameter is ready.
    groups.sort(key=lambda members: members[-1])
    buckets = []
    for index, members in enumerate(groups):
        info = params[members[0]]
        align = max(1, align_bytes // info.itemsize)
        offsets, end = [], 0
        for i in members:
            offsets.append(_aligned(end, align))
            end = offsets[-1] + params[i].numel
        numels = tuple(params[i].numel for i in members)
        buckets.append(Bucket(index, info.dtype, info.device, tuple(members), tuple(offsets), numels, end))
    return buckets


def describe_layout(params: Sequence[ParamInfo], buckets: Sequence[Bucket]) -> list[str]:
    """One readable line per parameter and per bucket: what ranks must agree on."""
    # The device type only: rank 0's cuda:0 and rank 1's cuda:1 are the same layout.
    lines = [
        f"param {i} {p.name} {p.shape} {str(p.dtype).replace('torch.', '')} "
        f"{p.device.split(':')[0]}"
        for i, p in enumerate(params)
    ]
    lines += [
        f"bucket {b.index} {str(b.dtype).replace('torch.', '')} params={list(b.params)} "
        f"offsets={list(b.offsets)} numel={b.numel}"
        for b in buckets
    ]
    return lines


def explain_layout(owner: str, ranks: Sequence[int], layouts: Sequence[Sequence[str]]) -> str:
    """The error for ranks whose `describe_layout` lines differ: each rank against the first."""
    first = layouts[0]
    report = [f"{owner}: the ranks' parameters differ, so their gradients cannot be averaged:"]
    for rank, theirs in zip(ranks[1:], layouts[1:], strict=True):
        if theirs == first:
            continue
        n_mine = sum(line.startswith("param ") for line in first)
        n_theirs = sum(line.startswith("param ") for line in theirs)
        if n_mine != n_theirs:
            report.append(f"  rank {ranks[0]} has {n_mine} parameters, rank {rank} has {n_theirs}")
        differing = [(a, b) for a, b in zip(first, theirs, strict=False) if a != b]
        for mine, other in differing[:4]:
            report.append(f"  rank {ranks[0]}: {mine}\n  rank {rank}: {other}")
    report.append("Build the same model, optimizer and options on every rank of the group.")
    return "\n".join(report)
