"""The sequence split's messages: tensors packed as bytes behind a small header that says which
attention call they belong to, so that a rank that skipped one is named, never garbage.

Inside a context-parallel model's forward, the attention calls communicate with no agreement
of their own (the forward and the backward each open with one: `parallel/model_check.py`).
Within a forward, though, a rank that skips an attention call (a branch taken on its data
alone) would have its next call's keys matched with the others' current ones: same shapes,
wrong tokens, a silently wrong loss. So each message carries, in front of its bytes, the call's
number in this forward and a code of its arguments (shapes, mask, scale): the receiver compares
them with its own before anything it received is used. In the ring every block comes from one
rank and travels on, so by the end of a ring each rank has seen every rank's header; in the
all-to-all each rank hears from every rank at once. Every rank therefore raises the same
`DivergedError`, naming each rank's call; no extra message and no host synchronisation (the
header is read where the data arrived, on the host). With checks off, or on a device tensor
(NCCL: the read would be a device synchronisation), the header is left out, as the per-forward
agreement is.
"""

from __future__ import annotations

import time

import torch

from tandem.comm import context
from tandem.comm.agreement.agree import DivergedError
from tandem.comm.collectives import direct
from tandem.comm.collectives.user import Staging
from tandem.comm.engines.backend import Group
from tandem.comm.groups import group_rank, group_ranks, group_size

_TAG = 7  # the ring's point-to-point tag (its messages are paired by order within the tag)
#: seconds this process waited in the split's messages, for benchmarks (two clock reads a message)
waited = {"s": 0.0}
HEADER = 3  # int64 values: the call's number in this forward, codes of its module and its arguments


def pack(tensors: list[torch.Tensor], header: torch.Tensor | None) -> torch.Tensor:
    """One flat uint8 buffer: the header (if any), then the tensors' bytes (one dtype)."""
    data = torch.stack(tensors).reshape(-1).view(torch.uint8)
    if header is None:
        return data
    return torch.cat([header.view(torch.uint8), data])


def unpack(buffer: torch.Tensor, like: torch.Tensor, count: int, checked: bool, read: bool = True
           ) -> tuple[list[torch.Tensor], list[int] | None]:
    """`pack`'s inverse: `count` tensors shaped like `like` (views of `buffer`), and the header
    (`read`: read on the host; else only skipped)."""
    skip = 8 * HEADER if checked else 0
    data = buffer[skip:].view(like.dtype).view(count, *like.shape)
    header = buffer[:skip].clone().view(torch.int64).tolist() if checked and read else None
    return list(data.unbind(0)), header


def header_of(call: int, module: int, code: int, checked: bool) -> torch.Tensor | None:
    return torch.tensor([call, module, code], dtype=torch.int64) if checked else None


class Ring:
    """Exchanges with the neighbours of a ring over `group`: send to the next rank, receive from
    the previous one, both started at once (each rank sends and receives, nobody waits first)."""

    def __init__(self, group: Group | None) -> None:
        self.group = group
        ranks, me = group_ranks(group), group_rank(group)
        n = len(ranks)
        self.next, self.prev = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def start(self, buffer: torch.Tensor):
        """Send `buffer`, receive one of its size: `wait()` gives the received buffer."""
        engine = context.current()
        out = Staging(torch.empty_like(buffer), engine)
        source = Staging(buffer.contiguous(), engine)
        sent, _ = direct.send(source.buffer, self.next, _TAG, self.group)
        got, _ = direct.recv(out.buffer, self.prev, _TAG, self.group)
        return _Pending(sent, got, out, engine.timeout, source)


class _Pending:
    __slots__ = ("sent", "got", "out", "timeout", "source")

    def __init__(self, sent, got, out, timeout, source) -> None:
        self.sent, self.got, self.out, self.timeout, self.source = sent, got, out, timeout, source

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        self.got.wait(self.timeout)
        self.sent.wait(self.timeout)
        waited["s"] += time.perf_counter() - start
        return self.out.copy_back()


def alltoall(tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group | None,
             header: torch.Tensor | None, read: bool = True
             ) -> tuple[torch.Tensor, list[list[int]] | None]:
    """Cut `tensor` into `sp` parts along `scatter_dim`, send part j to group rank j, and join
    the parts received along `gather_dim` (group rank order). Returns the result and, checked,
    every rank's header (in group rank order; `read`: else only skipped)."""
    sp = group_size(group)
    parts = torch.stack(tensor.chunk(sp, scatter_dim))  # (sp, ...): part j for rank j
    rows = parts.reshape(sp, -1).view(torch.uint8)
    if header is not None:
        rows = torch.cat([header.view(torch.uint8).expand(sp, -1), rows], 1)
    width = rows.shape[1]
    start = time.perf_counter()
    got = direct.alltoall(rows.contiguous(), [1] * sp, [1] * sp, group).view(sp, width)
    waited["s"] += time.perf_counter() - start
    skip = 8 * HEADER if header is not None else 0
    data = got[:, skip:].view(tensor.dtype).reshape(parts.shape)
    headers = (got[:, :skip].contiguous().view(torch.int64).tolist()
               if header is not None and read else None)
    return torch.cat(data.unbind(0), gather_dim), headers


def refuse_diverged(mine: list[int], seen: dict[int, list[int]], group: Group | None,
                    owner: str, names: dict[int, str]) -> None:
    """Raise `DivergedError` unless every rank's header in `seen` (group rank -> header) is
    `mine`: the ranks are at different attention calls of the forward, or call it differently.
    `names`: module code -> the module's name in the model (every rank has the same model)."""
    if all(h == mine for h in seen.values()):
        return
    ranks = group_ranks(group)
    seen = {**seen, group_rank(group): mine}
    lines = "\n".join(f"  rank {ranks[i]}: attention call #{h[0]} of this forward of {owner}, in "
                      f"{names.get(h[1], '(a module of another model)')!r} (arguments {h[2]:#010x})"
                      for i, h in sorted(seen.items()))
    raise DivergedError(
        f"context parallelism: the ranks of the sequence-split group {list(ranks)} are at "
        f"different attention calls, or make one call with different arguments (what was "
        f"received was not used):\n{lines}\nEvery rank of the group holds a part of every "
        f"sequence, so each must make the same attention calls in the same order, with the same "
        f"shapes, mask and scale: a branch taken on some ranks only (an early exit on a rank's "
        f"own data, `if td.rank() == 0`) must be taken on all of them, decided from values the "
        f"ranks share.")
