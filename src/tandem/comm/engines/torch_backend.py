"""Gloo (CPU) and NCCL (GPU) through torch.distributed."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta
from itertools import count

import torch
import torch.distributed as dist

from tandem import rendezvous
from tandem.comm.engines import sockets
from tandem.comm.engines.backend import Backend, CompletedWork, Work
from tandem.job import settings
from tandem.job.environments import JobEnvironment
from tandem.job.environments.adapters import meeting_tag
from tandem.rendezvous import roll_call

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


def _options(make, **fields):
    options = make()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


# made once: the process group copies what it reads of them
_ALLREDUCE_OPTIONS = {name: _options(dist.AllreduceOptions, reduceOp=op, asyncOp=True)
                      for name, op in _OPS.items()}
_gather_options = getattr(dist.distributed_c10d, "AllgatherOptions", None)
_ALLGATHER_OPTIONS = None if _gather_options is None else _options(_gather_options, asyncOp=True)
# complex travels as its real view, fp8 as bytes on older GPUs: torch's wrapper does that
_NOT_DIRECT = frozenset({torch.complex32, torch.complex64, torch.complex128}
                        | {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2",
                                                             "float8_e4m3fnuz", "float8_e5m2fnuz")
                           if hasattr(torch, name)})

# torch 2.13 named the flat-tensor collectives `all_gather_single` / `reduce_scatter_single` and
# deprecated the old names (a FutureWarning per call); older torch (2.11 on the GPU machines) has
# only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Each init in one process gets its own key prefix, so a shutdown followed by a new init on the
# same hosted store (the test harness does this) never reads the previous rendezvous' keys.
_generation = count()


class TorchWork(Work):
    def __init__(self, work: dist.Work | None) -> None:
        self._work = work

    def wait(self, timeout: float | None = None) -> None:
        if self._work is None:
            return
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise TimeoutError(str(error)) from error
            raise

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _agree_port_over_mpi(job: JobEnvironment, timeout: float) -> dist.Store:
    """Under mpiexec without MASTER_PORT: rank 0 hosts the store and tells the others, with a
    new key for it, over MPI (the store is authenticated as a launcher's is)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    store = None
    if job.rank == 0:
        key = rendezvous.new_key()
        store = rendezvous.host_store("0.0.0.0", 0, timeout, key)
        address = (socket.gethostname(), store.port, key)
    else:
        address = None
    host, port, key = comm.bcast(address, root=0)
    if store is None:
        store = rendezvous.connect_store(host, port, timeout, key)
    return store


def rendezvous_store(job: JobEnvironment, timeout: float) -> dist.Store:
    """The store the ranks of `job` meet on: the launcher's, rank 0's, or one agreed over MPI."""
    if job.size == 1:
        return dist.HashStore()
    if job.master_port is None:
        if job.under_mpi:
            try:
                return _agree_port_over_mpi(job, timeout)
            except ImportError:
                pass
        raise ValueError(
            f"{job.source}: a job of {job.size} ranks needs a rendezvous port; set MASTER_ADDR "
            "and MASTER_PORT, or start it with `tandem run`"
        )
    addr = job.master_addr or "127.0.0.1"
    if job.source == "manual":
        return _manual_store(job, addr, timeout)
    if job.store_hosted or job.rank != 0:
        return rendezvous.connect_store(addr, job.master_port, timeout, job.store_key)
    return rendezvous.host_store(addr, job.master_port, timeout, job.store_key)


def _manual_store(job: JobEnvironment, addr: str, timeout: float) -> dist.Store:
    """The store of ranks numbered by hand (`td.init(rank=, world_size=)`): rank 0 hosts it and
    calls the roll, so that the user's numbering is checked before the engine connects, and
    every failure to meet names the ranks (`rendezvous.roll_call`)."""
    address = f"{addr}:{job.master_port}"
    if job.rank == 0:
        try:
            store = rendezvous.host_store(addr, job.master_port, timeout, job.store_key)
        except rendezvous.PortInUseError:
            raise roll_call.port_taken(address, job.size) from None
    else:
        roll_call.reach(addr, job.master_port, job.rank, job.size, timeout)
        try:
            store = rendezvous.connect_store(addr, job.master_port, timeout, job.store_key)
        except rendezvous.AuthenticationFailed:
            raise
        except ConnectionError:
            raise roll_call.host_unreachable(job.rank, job.size, address, timeout) from None
    roll_call.answer(store, job.rank, job.size, timeout, address)
    return store


class TorchBackend(Backend):
    """A thin layer over one torch.distributed default process group."""

    def __init__(self, name: str, rank: int, size: int, device: torch.device,
                 store: dist.Store | None = None, owns: bool = True) -> None:
        self.name = name
        # False: the default group was the script's (dist.init_process_group before td.init):
        # tandem uses it and leaves it to the script to destroy.
        self._owns = owns
        # torch keeps the C++ half of a store written in Python (rendezvous' authenticated
        # one), not the Python object: it must live as long as the process group.
        self._store = store
        self.rank = rank
        self.size = size
        self.device = device
        self._connections: set[str] = set()  # the sockets its groups opened (`abort`)
        self._world: dist.ProcessGroup | None = None  # the default group, once asked for
        self._broadcast_options: dict[tuple, dist.BroadcastOptions] = {}
        if name == "nccl":
            self.staging_device = device

    @classmethod
    def create(
        cls, name: str, job: JobEnvironment, timeout: float, device: torch.device
    ) -> TorchBackend:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised by someone else; tandem needs to own "
                "the default process group (call dist.destroy_process_group() first)"
            )
        # A restarted job (`tandem run --max-restarts`) may meet on the same store again: each
        # attempt (TANDEM_RESTART), and each round of an elastic job, gets keys of its own.
        tag = meeting_tag(job, settings.current().restart, next(_generation))
        base = rendezvous_store(job, timeout)
        store = dist.PrefixStore(f"tandem/{tag}", base)
        _, connections = sockets.opened_by(lambda: dist.init_process_group(
            name,
            store=store,
            rank=job.rank,
            world_size=job.size,
            timeout=timedelta(seconds=timeout),
            device_id=device if name == "nccl" else None,
        ))
        engine = cls(name, job.rank, job.size, device, base)
        engine._connections = connections
        return engine

    @staticmethod
    def _pg(group) -> dist.ProcessGroup | None:
        return None if group is None else group.handle

    def supports_device(self, device: torch.device) -> bool:
        return device.type == ("cuda" if self.name == "nccl" else "cpu")

    # The three calls small messages make most go to the process group itself: torch's Python
    # wrapper (a torch-function check, the group looked up, the coalescing state, new options)
    # is about fifteen Python calls per message, as much as tandem's own path with its check.
    # Plain dense tensors only; a complex, fp8 or subclassed tensor (DTensor) takes torch's way,
    # which knows how to send it.
    def _direct(self, group, *tensors: torch.Tensor) -> dist.ProcessGroup | None:
        for tensor in tensors:
            if type(tensor) is not torch.Tensor or tensor.dtype in _NOT_DIRECT:
                return None
        if group is not None:
            return group.handle
        if self._world is None:
            self._world = dist.group.WORLD
        return self._world

    def allreduce(self, tensor, op, group):
        pg = self._direct(group, tensor)
        if pg is None:
            return TorchWork(dist.all_reduce(tensor, _OPS[op], group=self._pg(group),
                                             async_op=True))
        return TorchWork(pg.allreduce([tensor], _ALLREDUCE_OPTIONS[op]))

    def broadcast(self, tensor, root, group):
        pg = self._direct(group, tensor)
        if pg is None:
            return TorchWork(dist.broadcast(tensor, root, group=self._pg(group), async_op=True))
        key = (pg, root)
        options = self._broadcast_options.get(key)
        if options is None:
            options = self._broadcast_options[key] = dist.BroadcastOptions()
            options.rootRank = root if group is None else dist.get_group_rank(pg, root)
            options.rootTensor = 0
            options.asyncOp = True
        return TorchWork(pg.broadcast([tensor], options))

    def allgather_into(self, output, input, group):
        pg = self._direct(group, output, input) if _ALLGATHER_OPTIONS is not None else None
        gather = getattr(pg, "all_gather_single", None)
        if gather is None:
            return TorchWork(
                _all_gather_single(output, input, group=self._pg(group), async_op=True)
            )
        return TorchWork(gather(output, input, _ALLGATHER_OPTIONS))

    def reduce(self, tensor, root, op, group):
        return TorchWork(dist.reduce(tensor, root, _OPS[op], group=self._pg(group), async_op=True))

    def reducescatter_into(self, output, input, op, group):
        return TorchWork(
            _reduce_scatter_single(
                output, input, _OPS[op], group=self._pg(group), async_op=True
            )
        )

    def alltoall_into(
        self, output, input, output_splits: Sequence[int], input_splits: Sequence[int], group
    ):
        return TorchWork(
            dist.all_to_all_single(
                output, input, list(output_splits), list(input_splits),
                group=self._pg(group), async_op=True,
            )
        )

    def gather(self, output, input, root, group):
        members = len(group.ranks) if group is not None else self.size
        parts = list(output.view(-1).chunk(members)) if output is not None else None
        return TorchWork(dist.gather(input.reshape(-1), parts, root, group=self._pg(group),
                                     async_op=True))

    def scatter(self, output, input, root, group):
        members = len(group.ranks) if group is not None else self.size
        parts = list(input.reshape(-1).chunk(members)) if input is not None else None
        return TorchWork(dist.scatter(output.view(-1), parts, root, group=self._pg(group),
                                      async_op=True))

    def send(self, tensor, dst, tag, group):
        return TorchWork(dist.isend(tensor, dst, group=self._pg(group), tag=tag))

    def recv(self, tensor, src, tag, group):
        return TorchWork(dist.irecv(tensor, src, group=self._pg(group), tag=tag))

    def barrier(self, group):
        if self.size == 1:
            return CompletedWork()
        return TorchWork(dist.barrier(group=self._pg(group), async_op=True))

    def new_group(self, ranks):
        group, connections = sockets.opened_by(lambda: dist.new_group(list(ranks)))
        self._connections |= connections
        return group

    def abort(self) -> None:
        # Every operation still pending on this rank's connections fails at once, here and on
        # the peers at their other ends (see `sockets`).
        sockets.shut(self._connections)

    def shutdown(self) -> None:
        if self._owns and dist.is_initialized():
            dist.destroy_process_group()
        if hasattr(self._store, "close"):  # ours (a TCPStore closes when dropped)
            self._store.close()
        self._store = None
