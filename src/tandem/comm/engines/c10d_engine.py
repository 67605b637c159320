"""Gloo (or NCCL) as an engine of its own: a c10d backend object, driven without a process group.

The torch.distributed backend "tandem" needs an engine below it when the job is not an MPI job
(torchrun, `tandem run --backend gloo`). `TorchBackend` cannot serve: it calls
`dist.all_reduce(...)` on torch's default group, which is then tandem's own group, itself. So
this engine holds torch's `ProcessGroupGloo` (`ProcessGroupNCCL`) objects directly, built on the
store torch gave the default group, and calls their methods with group-local ranks: one object
for the world, one more for each sub-group (made on the world's store under a prefix of its
own, by the members; every rank of the world calls `new_group`, in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from itertools import count
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.engines.backend import Backend, CompletedWork, Group, ThenWork
from tandem.comm.engines.torch_backend import TorchWork

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR}


class Members:
    """The engine handle behind a `Group`: its c10d object (None outside it) and its ranks."""

    __slots__ = ("pg", "ranks")

    def __init__(self, pg: Any, ranks: Sequence[int]) -> None:
        self.pg, self.ranks = pg, tuple(ranks)

    def local(self, global_rank: int, role: str) -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{role}={global_rank} is not a rank of the group "
                             f"{list(self.ranks)}") from None


class C10dEngine(Backend):
    """One process's place in a job whose messages torch's Gloo (or NCCL) objects carry."""

    def __init__(self, name: str, store: Any, rank: int, size: int, timeout: float,
                 device: torch.device) -> None:
        self.name, self.rank, self.size = name, rank, size
        self._store, self._timeout, self.device = store, timedelta(seconds=timeout), device
        self._world = Members(self._make(store, rank, size), range(size))
        self._groups = count()
        if name == "nccl":
            self.staging_device = device

    @classmethod
    def create(cls, name: str, store: Any, rank: int, size: int, timeout: float,
               device: torch.device) -> C10dEngine:
        return cls(name, dist.PrefixStore("tandem-engine/", store), rank, size, timeout, device)

    def _make(self, store: Any, rank: int, size: int) -> Any:
        if self.name == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        return dist.ProcessGroupGloo(store, rank, size, self._timeout)

    def supports_device(self, device: torch.device) -> bool:
        return device.type == ("cuda" if self.name == "nccl" else "cpu")

    def _members(self, group: Group | None) -> Members:
        members = self._world if group is None else group.handle
        if members.pg is None:
            raise ValueError(f"rank {self.rank} is not a member of {group!r}; only members may call it")
        return members

    # -- collectives ----------------------------------------------------------------------
    def allreduce(self, tensor, op, group):
        options = dist.AllreduceOptions()
        options.reduceOp = _OPS[op]
        return TorchWork(self._members(group).pg.allreduce([tensor], options))

    def broadcast(self, tensor, root, group):
        members = self._members(group)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = members.local(root, "root"), 0
        return TorchWork(members.pg.broadcast([tensor], options))

    def allgather_into(self, output, input, group):
        return TorchWork(self._members(group).pg._allgather_base(output, input))

    def reduce(self, tensor, root, op, group):
        members = self._members(group)
        options = dist.ReduceOptions()
        options.reduceOp, options.rootRank = _OPS[op], members.local(root, "root")
        return TorchWork(members.pg.reduce([tensor], options))

    def reducescatter_into(self, output, input, op, group):
        members = self._members(group)
        if self.name == "nccl":
            options = dist.ReduceScatterOptions()
            options.reduceOp = _OPS[op]
            return TorchWork(members.pg._reduce_scatter_base(output, input, options))
        # Gloo has no reduce-scatter of one flat tensor: all-reduce it, keep this rank's part.
        whole = input.clone()
        work = self.allreduce(whole, op, group)
        n, index = output.numel(), members.local(self.rank, "rank")
        return ThenWork(work, lambda: output.view(-1).copy_(whole.view(-1)[index * n:(index + 1) * n]))

    def alltoall_into(self, output, input, output_splits: Sequence[int],
                      input_splits: Sequence[int], group):
        return TorchWork(self._members(group).pg.alltoall_base(
            output, input, list(output_splits), list(input_splits), dist.AllToAllOptions()))

    def gather(self, output, input, root, group):
        members = self._members(group)
        options = dist.GatherOptions()
        options.rootRank = members.local(root, "root")
        outputs = [list(output.view(-1).chunk(len(members.ranks)))] if output is not None else []
        return TorchWork(members.pg.gather(outputs, [input.reshape(-1)], options))

    def scatter(self, output, input, root, group):
        members = self._members(group)
        options = dist.ScatterOptions()
        options.rootRank = members.local(root, "root")
        inputs = [list(input.reshape(-1).chunk(len(members.ranks)))] if input is not None else []
        return TorchWork(members.pg.scatter([output.view(-1)], inputs, options))

    def send(self, tensor, dst, tag, group):
        members = self._members(group)
        return TorchWork(members.pg.send([tensor], members.local(dst, "dst"), tag))

    def recv(self, tensor, src, tag, group):
        members = self._members(group)
        return TorchWork(members.pg.recv([tensor], members.local(src, "src"), tag))

    def barrier(self, group):
        if self.size == 1:
            return CompletedWork()
        return TorchWork(self._members(group).pg.barrier(dist.BarrierOptions()))

    # -- groups and lifetime --------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> Members:
        """The members build their object on the world's store, under the group's own prefix
        (every rank counts every group, so the prefixes agree)."""
        members = tuple(ranks)
        prefix = f"group/{next(self._groups)}/"
        if self.rank not in members:
            return Members(None, members)
        store = dist.PrefixStore(prefix, self._store)
        return Members(self._make(store, members.index(self.rank), len(members)), members)

    def shutdown(self) -> None:
        self._world = Members(None, ())
        self._store = None

