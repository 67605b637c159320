"""The backend protocol: what an engine (Gloo/NCCL through torch.distributed, or MPI) provides.

Backends are deliberately small. They work *in place* on contiguous tensors, are always
asynchronous (every call returns a `Work`), know only the reductions an engine has natively
(`sum`, `min`, `max`, `product`) and use *global* ranks for roots, sources and destinations.
Everything a user sees on top of that (mean, copies, NumPy, argument agreement, uneven
all-gather) lives in `tandem.comm.collectives.user`, once, for every backend.

The data-parallel reducer and the pipeline executor call a backend directly: they agree on
their layouts once and must pay nothing per message.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Reductions every backend implements natively. "mean" is built on "sum" one level up; the
#: bitwise three (integer and bool tensors) serve torch.distributed's ReduceOp through
#: `torch_pg`, tandem's own collectives do not offer them.
NATIVE_OPS = ("sum", "min", "max", "product", "band", "bor", "bxor")


@dataclass(frozen=True, eq=False)
class Group:
    """An ordered set of global ranks that communicate together (made by `groups.new_group`).

    `handle` is the engine's own object for the group; `rank` is this process's index in the
    group (-1 when it is not a member). Roots, sources and destinations passed to collectives
    stay *global* ranks, as in torch.distributed. Defined here, beside the protocol that
    receives it, so that the engines need nothing above this module.

    Made by `td.new_group` and `td.mesh`, not by users.

    Args:
        ranks: the global ranks of the group, in group-rank order.
        handle: the engine's own object for the group.
        rank: this process's index in `ranks`, or -1 when it is not a member.
    """

    ranks: tuple[int, ...]
    handle: object
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks

    def index(self, global_rank: int) -> int:
        """The group rank of a global rank."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in the group {list(self.ranks)}") from None

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)})"


class Work(abc.ABC):
    """An operation in flight."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completes; raise `TimeoutError` past `timeout` seconds."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Poll without blocking."""


class CompletedWork(Work):
    """A `Work` for operations that finished synchronously (a world of one, empty tensors)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class ThenWork(Work):
    """`work`, then `after()` once it completed (a result copied out of a staging buffer)."""

    __slots__ = ("_work", "_after")

    def __init__(self, work: Work, after) -> None:
        self._work, self._after = work, after

    def wait(self, timeout: float | None = None) -> None:
        self._work.wait(timeout)
        after, self._after = self._after, None
        if after is not None:
            after()

    def is_completed(self) -> bool:
        return self._work.is_completed()


class Backend(abc.ABC):
    """One communication engine bound to one process of one job."""

    name: str
    rank: int
    size: int

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str, group: Group | None) -> Work:
        """Reduce `tensor` across the group with a native op, in place, on every member."""

    def allreduce_now(self, tensor: torch.Tensor, op: str, group: Group | None) -> Work | None:
        """`allreduce` for a caller that waits at once: None if it already completed.

        A blocking `td.allreduce` of a few kilobytes takes microseconds on MPI, less than the
        asynchronous bookkeeping around it; engines that can finish such a message on the spot
        override this. A `Work` returned here must still be waited for.
        """
        return self.allreduce(tensor, op, group)

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, group: Group | None) -> Work:
        """Copy `tensor` from global rank `root` into `tensor` on every member."""

    def broadcast_now(self, tensor: torch.Tensor, root: int, group: Group | None) -> Work | None:
        """`broadcast` for a caller that waits at once: None if it already completed (as
        `allreduce_now`)."""
        return self.broadcast(tensor, root, group)

    @abc.abstractmethod
    def allgather_into(
        self, output: torch.Tensor, input: torch.Tensor, group: Group | None
    ) -> Work:
        """`output` (group.size × input rows) receives every member's `input`, in rank order."""

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, root: int, op: str, group: Group | None) -> Work:
        """Reduce into `tensor` on global rank `root`; other ranks' tensors are unspecified."""

    @abc.abstractmethod
    def reducescatter_into(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: Group | None
    ) -> Work:
        """`input` is group.size equal chunks along dim 0; member i gets the reduced chunk i."""

    @abc.abstractmethod
    def alltoall_into(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        group: Group | None,
    ) -> Work:
        """Rows `input_splits[j]` of `input` go to member j; `output_splits[i]` come from i."""

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, root: int,
               group: Group | None) -> Work:
        """`output` (group.size × input elements) on global rank `root` receives every member's
        `input`, in rank order; the other members pass None. Built on `allgather_into` here
        (every member receives it all); engines with a native gather override it."""
        size = group.size if group is not None else self.size
        buffer = (output.view(-1) if output is not None
                  else torch.empty(size * input.numel(), dtype=input.dtype, device=input.device))
        return self.allgather_into(buffer, input.reshape(-1), group)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, root: int,
                group: Group | None) -> Work:
        """Member i's `output` receives the i-th of group.size equal parts of `input`, which
        only global rank `root` passes (None elsewhere). Built on `broadcast` here (every
        member receives it all); engines with a native scatter override it."""
        members = group.ranks if group is not None else tuple(range(self.size))
        n = output.numel()
        buffer = (input.reshape(-1).clone() if input is not None
                  else torch.empty(len(members) * n, dtype=output.dtype, device=output.device))
        index = members.index(self.rank)

        def take() -> None:
            output.view(-1).copy_(buffer[index * n:(index + 1) * n])

        return ThenWork(self.broadcast(buffer, root, group), take)

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int, group: Group | None) -> Work:
        """Send `tensor` to global rank `dst`."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int, group: Group | None) -> Work:
        """Receive into `tensor` from global rank `src`."""

    @abc.abstractmethod
    def barrier(self, group: Group | None) -> Work:
        """Complete once every member has entered."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> object:
        """Create the engine's handle for a sub-group. Collective over the whole world."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource; the backend is unusable afterwards."""

    def abort(self) -> None:
        """The world is broken (a peer died; an elastic job moves on without it): drop every
        connection now, so that the peers still waiting on this rank fail at once instead of
        at their timeout. `shutdown()` still follows. Engines that cannot: nothing."""
        return None

    #: Where a tensor on a device the engine does not take is copied for it (`on_wire`).
    staging_device = torch.device("cpu")

    def supports_device(self, device: torch.device) -> bool:
        """Whether tensors on `device` can be passed directly (else `on_wire` stages them)."""
        return device.type == "cpu"


def on_wire(tensor: torch.Tensor, backend: Backend, *, keep_values: bool = True) -> torch.Tensor:
    """`tensor` itself when `backend` takes its device, else a copy on the device it does take
    (NCCL: this rank's GPU; Gloo: the CPU). `keep_values=False`: an empty buffer there instead,
    for a message about to be received. The caller copies a staged result back.

    The one place that decides where a message travels from: collectives, the reducer's
    helpers, ZeRO, fully_shard, the pipeline's links and the agreements all stage through it.
    """
    if backend.supports_device(tensor.device):
        return tensor
    # A GPU tensor bound for the host goes through page-locked memory: a pageable copy runs at
    # a fraction of the bus's speed (td.allreduce over Gloo measured 2.2x the raw call at 64 MB
    # on an H100 before). torch's host allocator caches these pages, so a repeat is cheap.
    pinned = tensor.device.type == "cuda" and backend.staging_device.type == "cpu"
    buffer = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=backend.staging_device,
                         pin_memory=pinned)
    if keep_values:
        buffer.copy_(tensor)
    return buffer
