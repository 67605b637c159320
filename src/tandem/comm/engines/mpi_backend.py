"""MPI through mpi4py: the backend for jobs started by `mpiexec` (or `srun --mpi=pmi2`).

Stock pip PyTorch has no MPI built in; this backend drives MPI from Python with mpi4py and
works with any MPI library it was built against (the `mpich` wheel by default). Every
operation is non-blocking (`Iallreduce`, `Ibcast`, ..., `Isend`/`Irecv`, `Ibarrier`) and
returns an `MPIWork` whose `wait(timeout)` ends in a `TimeoutError` naming the operation and
the peers; `mpi_progress` explains how operations move while nobody waits.

CPU tensors go to MPI zero-copy as raw addresses; the dtypes MPI cannot reduce (float16,
bfloat16, bool) are reduced in a wider stand-in; CUDA tensors go straight through a
CUDA-aware MPI, else through pinned host memory (see `mpi_buffers`).

The backend owns a duplicate of `MPI_COMM_WORLD`, so its messages never match those of a
script that uses mpi4py itself; `MPI_Finalize` is left to mpi4py's exit handler. Nothing here
depends on the process manager (Hydra, Open MPI's, SLURM's PMI): only on `MPI_COMM_WORLD`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tandem.comm.engines import mpi_exit
from tandem.comm.engines.backend import Backend, Group, Work
from tandem.comm.engines.mpi_buffers import Staging, cuda_aware, row_elements, wire_dtype
from tandem.comm.engines.mpi_progress import MPIWork, Progress, Requests, completed_within
from tandem.comm.engines.mpi_setup import arrive, import_mpi, show_launcher, spare_core
from tandem.job import settings
from tandem.job.environments import JobEnvironment

# How long a blocking all-reduce is driven by its caller before it becomes a watched MPIWork:
# a 16 MB message takes ~2.5 ms here; a hang is reported after seconds, so this is invisible.
ON_THE_SPOT_S = 0.01
# All-reduces from PIECES_FROM_BYTES up go to MPI in pieces of PIECE_BYTES (see _iallreduce).
PIECES_FROM_BYTES = 8 << 20
PIECE_BYTES = 4 << 20
_MOST_SPECS = 256  # buffer specs kept for repeated blocking all-reduces (allreduce_now)


class Communicator:
    """The engine handle behind a `Group`: an MPI communicator and its rank translation.

    Non-members get one with `comm=None`; it is never used for communication.
    """

    __slots__ = ("comm", "ranks", "local")

    def __init__(self, comm: Any, ranks: Sequence[int]) -> None:
        self.comm = comm
        self.ranks = tuple(ranks)
        self.local = {rank: index for index, rank in enumerate(self.ranks)}

    def rank_of(self, global_rank: int, role: str) -> int:
        """The communicator rank of a global rank (roots, sources and destinations are global)."""
        try:
            return self.local[global_rank]
        except KeyError:
            raise ValueError(
                f"{role}={global_rank} is not a rank of the group {list(self.ranks)}"
            ) from None

    def peers(self, me: int) -> list[int]:
        return [rank for rank in self.ranks if rank != me]


class MPIBackend(Backend):
    """One process's place in an MPI job."""

    name = "mpi"
    previous: tuple[int, ...] = ()  # after `shrink`: each rank's rank in the world before

    def __init__(self, MPI: Any, comm: Any, timeout: float, progress: str) -> None:
        self._MPI = MPI
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._world = Communicator(comm, range(self.size))
        self._groups: list[Any] = []  # sub-communicators to free at shutdown
        threaded = progress == "thread" and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.progress = Progress(MPI, threaded, timeout)
        self.staging = Staging(MPI, cuda_aware())
        self._ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD,
                     "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
        self._in_place = MPI.IN_PLACE
        self._tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
        self._specs: dict[tuple, list] = {}  # (address, count, dtype) -> spec (allreduce_now)
        self._closed = False

    @classmethod
    def create(cls, job: JobEnvironment, timeout: float) -> MPIBackend:
        """Join `MPI_COMM_WORLD` (initialising MPI on first use) and check it is this job."""
        progress = settings.current().mpi_progress  # auto | thread | none, checked there
        if progress == "auto":
            progress = "thread" if spare_core(job.local_size) else "none"
        MPI = import_mpi()
        world = MPI.COMM_WORLD
        if (world.Get_size(), world.Get_rank()) != (job.size, job.rank):
            raise RuntimeError(
                f"backend 'mpi': MPI sees rank {world.Get_rank()} of {world.Get_size()}, but "
                f"the job ({job.source}) says rank {job.rank} of {job.size}. MPI can only join "
                "processes its own launcher started: run `mpiexec -n N python script.py`, "
                "`tandem run --backend mpi -np N script.py` or `srun --mpi=pmi2 ...`, or "
                "choose backend='gloo'"
            )
        arrive(MPI, world, timeout, "init (every rank must call td.init)")
        show_launcher(job)
        mpi_exit.install(MPI, timeout)  # a failed rank must not hang in MPI_Finalize
        comm = world.Dup()
        return cls(MPI, comm, timeout, progress)

    # -- helpers --------------------------------------------------------------------------
    def _handle(self, group: Group | None) -> Communicator:
        if group is None:
            return self._world
        handle = group.handle
        if handle.comm is None:
            raise ValueError(
                f"rank {self.rank} is not a member of {group!r}; only members may call it"
            )
        return handle

    def _work(self, request, after, refs, what, cancel_on_timeout=False) -> Work:
        return MPIWork(self.progress, request, after, refs, what, cancel_on_timeout)

    def _check_tag(self, tag: int) -> int:
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"tag={tag}: MPI tags must be between 0 and {self._tag_ub}")
        return tag

    # -- collectives ----------------------------------------------------------------------
    def allreduce(self, tensor, op, group):
        # The gradient reducer's call: kept to the minimum (a few microseconds over mpi4py), so
        # _post_allreduce and _allreduce_work are written out here.
        handle = self._world if group is None else self._handle(group)
        spec, after = self.staging.spec(tensor, True)
        return MPIWork(self.progress, self._iallreduce(handle.comm, spec, self._ops[op]),
                       (after,) if after else (), (tensor, spec),
                       (_collective, "allreduce", tensor, self.rank, handle, op))

    def allreduce_now(self, tensor, op, group):
        # A blocking td.allreduce: the caller drives it on the spot, which finishes messages up
        # to tens of megabytes as fast as a blocking MPI_Allreduce, without the progress
        # bookkeeping. Only a longer wait becomes an MPIWork, watched and bounded by a deadline.
        # The common case first: a contiguous CPU tensor seen before (its buffer spec is kept).
        spec = self._specs.get((tensor.data_ptr(), tensor.numel(), tensor.dtype))
        if spec is not None and tensor.is_contiguous() and not tensor.is_cuda:
            handle = self._world if group is None else self._handle(group)
            request = handle.comm.Iallreduce(self._in_place, spec, self._ops[op])
            try:
                if request.Test() or completed_within(request, ON_THE_SPOT_S):
                    return None
            except self._MPI.Exception as error:
                described = _collective("allreduce", tensor, self.rank, handle, op)[0]
                raise RuntimeError(f"MPI {described} failed: {error}") from error
            return self._allreduce_work(request, None, spec, handle, tensor, op)
        posted = self._post_allreduce(tensor, op, group)
        try:
            done = completed_within(posted[0], ON_THE_SPOT_S)
        except self._MPI.Exception as error:
            described = _collective("allreduce", tensor, self.rank, posted[3], op)[0]
            raise RuntimeError(f"MPI {described} failed: {error}") from error
        if not done:
            return self._allreduce_work(*posted)
        after = posted[1]
        if after is not None:
            after()
        return None

    def allreduce_plan(self, tensor, op, ledger=None):
        """A blocking all-reduce of `tensor`'s memory on the world, prepared once: `run(t)`
        reduces `t` (a tensor at that address, with that count and dtype, contiguous) and
        returns None, or a watched `Work` when it did not finish on the spot. None when the
        tensor cannot take it (not a contiguous CPU tensor of a dtype MPI reduces natively, or
        a message sent in pieces).

        What a repeated small `td.allreduce` runs: the message, the on-the-spot drive and the
        count of `ledger` (the watchdog's), with no look-up or check between (issue 46, item
        2: each microsecond of Python is a third of a 4 KB message here). The plan holds a raw
        address, never the tensor: the caller keeps it by address, count and dtype, as
        `allreduce_now` keeps its specs, so it also serves a later tensor at that address.
        """
        if tensor.is_cuda or not tensor.is_contiguous() or not tensor.numel() \
                or wire_dtype(tensor.dtype) is not tensor.dtype:
            return None
        spec, _ = self.staging.spec(tensor, True)  # (no stand-in: the dtype is MPI's own)
        if len(spec[0]) >= PIECES_FROM_BYTES:
            return None
        post, in_place, mpi_op = self._world.comm.Iallreduce, self._in_place, self._ops[op]
        failure, world = self._MPI.Exception, self._world
        count = None if ledger is None else ledger.count

        def run(tensor):
            request = post(in_place, spec, mpi_op)
            test = request.Test
            try:
                done = test() or test() or completed_within(request, ON_THE_SPOT_S)
            except failure as error:
                described = _collective("allreduce", tensor, self.rank, world, op)[0]
                raise RuntimeError(f"MPI {described} failed: {error}") from error
            if done:
                if count is not None:
                    count(None)
                return None
            work = self._allreduce_work(request, None, spec, world, tensor, op)
            return work if ledger is None else ledger.issue(work, "allreduce", None, tensor)
        return run

    def _post_allreduce(self, tensor, op, group):
        """(request, copy-back step or None, spec, communicator, tensor, op) of a posted all-reduce."""
        handle = self._world if group is None else self._handle(group)
        spec, after = self.staging.spec(tensor, True)
        if after is None and not tensor.is_cuda and len(spec[0]) < PIECES_FROM_BYTES:
            # Kept by address, count and dtype: making the spec costs as much as a small
            # message's Python (0.7 us of 3.7 here), and an address that a later tensor reuses
            # with the same count and dtype needs the same spec. A few hundred are kept.
            if len(self._specs) >= _MOST_SPECS:
                self._specs.clear()
            self._specs[(tensor.data_ptr(), tensor.numel(), tensor.dtype)] = spec
        return self._iallreduce(handle.comm, spec, self._ops[op]), after, spec, handle, tensor, op

    def _allreduce_work(self, request, after, spec, handle, tensor, op) -> MPIWork:
        return MPIWork(self.progress, request, (after,) if after else (), (tensor, spec),
                       (_collective, "allreduce", tensor, self.rank, handle, op))

    def _iallreduce(self, comm, spec: list, op):
        """`Iallreduce`, posted in `PIECE_BYTES` pieces when the message is large.

        On MPICH here a large message goes faster in pieces: `benchmarks/allreduce.py` has
        tandem at 1.17x raw mpi4py's (whole-message) bandwidth at 16 MB and 1.31x at 256 MB
        (even at 64 MB), and `benchmarks/dp_vs_ddp.py`'s MLP step went from 47 to 44 ms. Every
        rank posts the pieces back to back, so they match in order like one operation.
        """
        buffer, count, datatype = spec
        nbytes = len(buffer)
        if nbytes < PIECES_FROM_BYTES:
            return comm.Iallreduce(self._in_place, spec, op)
        itemsize = nbytes // count
        per_piece = PIECE_BYTES // itemsize
        pieces = []
        for first in range(0, count, per_piece):
            n = min(per_piece, count - first)
            piece = [buffer[first * itemsize:(first + n) * itemsize], n, datatype]
            pieces.append(comm.Iallreduce(self._in_place, piece, op))
        return Requests(self._MPI.Request, pieces)

    def broadcast_now(self, tensor, root, group):
        # As allreduce_now: a contiguous CPU tensor seen before goes to MPI with its kept spec.
        key = (tensor.data_ptr(), tensor.nbytes, None)
        spec = self._specs.get(key)
        if spec is None or not tensor.is_contiguous() or tensor.is_cuda:
            work = self.broadcast(tensor, root, group)
            if not tensor.is_cuda and tensor.is_contiguous() and 0 < tensor.nbytes < PIECES_FROM_BYTES:
                if len(self._specs) >= _MOST_SPECS:
                    self._specs.clear()
                self._specs[key] = [self.staging.fromaddress(tensor.data_ptr(), tensor.nbytes),
                                    tensor.nbytes, self._MPI.BYTE]
            return work
        handle = self._world if group is None else self._handle(group)
        request = handle.comm.Ibcast(spec, handle.rank_of(root, "root"))
        try:
            if request.Test() or completed_within(request, ON_THE_SPOT_S):
                return None
        except self._MPI.Exception as error:
            described = _collective("broadcast", tensor, self.rank, handle, None, root)[0]
            raise RuntimeError(f"MPI {described} failed: {error}") from error
        return self._work(request, (), (tensor, spec),
                          (_collective, "broadcast", tensor, self.rank, handle, None, root))

    def broadcast_plan(self, tensor, root, ledger=None):
        """A blocking broadcast of `tensor`'s memory from `root` on the world, prepared once,
        as `allreduce_plan` prepares an all-reduce: `run(t)` returns None, or a watched `Work`
        when it did not finish on the spot. None for a tensor it cannot take."""
        if tensor.is_cuda or not tensor.is_contiguous() or not 0 < tensor.nbytes < PIECES_FROM_BYTES:
            return None
        spec = [self.staging.fromaddress(tensor.data_ptr(), tensor.nbytes), tensor.nbytes,
                self._MPI.BYTE]
        post, local_root = self._world.comm.Ibcast, self._world.rank_of(root, "root")
        failure, world = self._MPI.Exception, self._world
        count = None if ledger is None else ledger.count

        def run(tensor):
            request = post(spec, local_root)
            test = request.Test
            try:
                done = test() or test() or completed_within(request, ON_THE_SPOT_S)
            except failure as error:
                described = _collective("broadcast", tensor, self.rank, world, None, root)[0]
                raise RuntimeError(f"MPI {described} failed: {error}") from error
            if done:
                if count is not None:
                    count(None)
                return None
            work = self._work(request, (), (tensor, spec),
                              (_collective, "broadcast", tensor, self.rank, world, None, root))
            return work if ledger is None else ledger.issue(work, "broadcast", None, tensor)
        return run

    def broadcast(self, tensor, root, group):
        handle = self._handle(group)
        local_root = handle.rank_of(root, "root")
        is_root = root == self.rank
        spec, after = self.staging.spec(tensor, reduce=False, copy_in=is_root,
                                        copy_out=not is_root)
        request = handle.comm.Ibcast(spec, local_root)
        return self._work(request, _steps(after), (tensor, spec),
                          (_collective, "broadcast", tensor, self.rank, handle, None, root))

    def allgather_into(self, output, input, group):
        handle = self._handle(group)
        if output.dtype != input.dtype or output.numel() != input.numel() * len(handle.ranks):
            raise ValueError(
                f"allgather: output ({output.numel()} {output.dtype}) must be "
                f"{len(handle.ranks)} times the input ({input.numel()} {input.dtype})"
            )
        if _overlap(input, output):
            # FSDP2 gathers from this rank's slot of the output itself; MPI refuses aliased
            # buffers, and the slot is one part in N: a copy of it is cheap.
            input = input.clone()
        send, after_in = self.staging.spec(input, reduce=False, copy_out=False)
        recv, after_out = self.staging.spec(output, reduce=False, copy_in=False)
        recv[1] = send[1]  # mpi4py counts are per member
        request = handle.comm.Iallgather(send, recv)
        return self._work(request, _steps(after_in, after_out), (input, output, send, recv),
                          (_collective, "allgather", input, self.rank, handle))

    def reduce(self, tensor, root, op, group):
        handle = self._handle(group)
        local_root = handle.rank_of(root, "root")
        is_root = root == self.rank
        spec, after = self.staging.spec(tensor, reduce=True, copy_out=is_root)
        if is_root:
            request = handle.comm.Ireduce(self._in_place, spec, self._ops[op], local_root)
        else:
            request = handle.comm.Ireduce(spec, None, self._ops[op], local_root)
        return self._work(request, _steps(after), (tensor, spec),
                          (_collective, "reduce", tensor, self.rank, handle, op, root))

    def reducescatter_into(self, output, input, op, group):
        handle = self._handle(group)
        if output.dtype != input.dtype or input.numel() != output.numel() * len(handle.ranks):
            raise ValueError(
                f"reducescatter: input ({input.numel()} {input.dtype}) must be "
                f"{len(handle.ranks)} times the output ({output.numel()} {output.dtype})"
            )
        input = input.clone() if _overlap(input, output) else input  # MPI: no aliasing
        send, after_in = self.staging.spec(input, reduce=True, copy_out=False)
        recv, after_out = self.staging.spec(output, reduce=True, copy_in=False)
        send[1] = recv[1]  # mpi4py counts are per member
        request = handle.comm.Ireduce_scatter_block(send, recv, self._ops[op])
        return self._work(request, _steps(after_in, after_out), (input, output, send, recv),
                          (_collective, "reducescatter", input, self.rank, handle, op))

    def alltoall_into(
        self, output, input, output_splits: Sequence[int], input_splits: Sequence[int], group
    ):
        handle = self._handle(group)
        n = len(handle.ranks)
        if len(output_splits) != n or len(input_splits) != n:
            raise ValueError(
                f"alltoall: splits {list(input_splits)} / {list(output_splits)} need one count "
                f"for each of the {n} members"
            )
        input = input.clone() if _overlap(input, output) else input  # MPI: no aliasing
        send, after_in = self.staging.spec(input, reduce=False, copy_out=False)
        recv, after_out = self.staging.spec(output, reduce=False, copy_in=False)
        send[1:] = _counts(input_splits, row_elements(input) * input.element_size()), send[2]
        recv[1:] = _counts(output_splits, row_elements(output) * output.element_size()), recv[2]
        request = handle.comm.Ialltoallv(send, recv)
        return self._work(request, _steps(after_in, after_out), (input, output, send, recv),
                          (_collective, "alltoall", input, self.rank, handle))

    def gather(self, output, input, root, group):
        handle = self._handle(group)
        local_root = handle.rank_of(root, "root")
        send, after_in = self.staging.spec(input, reduce=False, copy_out=False)
        recv, after_out = None, None
        if root == self.rank:
            if output is None or output.numel() != input.numel() * len(handle.ranks):
                raise ValueError(f"gather: the root's output must hold {len(handle.ranks)} times "
                                 f"the input's {input.numel()} elements")
            recv, after_out = self.staging.spec(output, reduce=False, copy_in=False)
            recv[1] = send[1]  # mpi4py counts are per member
        request = handle.comm.Igather(send, recv, local_root)
        return self._work(request, _steps(after_in, after_out), (input, output, send, recv),
                          (_collective, "gather", input, self.rank, handle, None, root))

    def scatter(self, output, input, root, group):
        handle = self._handle(group)
        local_root = handle.rank_of(root, "root")
        recv, after_out = self.staging.spec(output, reduce=False, copy_in=False)
        send, after_in = None, None
        if root == self.rank:
            if input is None or input.numel() != output.numel() * len(handle.ranks):
                raise ValueError(f"scatter: the root's input must hold {len(handle.ranks)} times "
                                 f"the output's {output.numel()} elements")
            send, after_in = self.staging.spec(input, reduce=False, copy_out=False)
            send[1] = recv[1]  # mpi4py counts are per member
        request = handle.comm.Iscatter(send, recv, local_root)
        return self._work(request, _steps(after_in, after_out), (input, output, send, recv),
                          (_collective, "scatter", output, self.rank, handle, None, root))

    def send(self, tensor, dst, tag, group):
        handle = self._handle(group)
        peer = handle.rank_of(dst, "dst")
        spec, after = self.staging.spec(tensor, reduce=False, copy_out=False)
        request = handle.comm.Isend(spec, peer, self._check_tag(tag))
        return self._work(request, _steps(after), (tensor, spec),
                          (_point_to_point, "send", spec[1], self.rank, dst, tag))

    def recv(self, tensor, src, tag, group):
        handle = self._handle(group)
        peer = handle.rank_of(src, "src")
        spec, after = self.staging.spec(tensor, reduce=False, copy_in=False)
        request = handle.comm.Irecv(spec, peer, self._check_tag(tag))
        return self._work(request, _steps(after), (tensor, spec),
                          (_point_to_point, "recv", spec[1], self.rank, src, tag),
                          cancel_on_timeout=True)

    def barrier(self, group):
        handle = self._handle(group)
        request = handle.comm.Ibarrier()
        return self._work(request, (), (), (_collective, "barrier", None, self.rank, handle))

    # -- groups and lifetime --------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> Communicator:
        """A communicator of `ranks` in that order; collective over the whole world."""
        members = [int(r) for r in ranks]
        world = self._world.comm
        arrive(self._MPI, world, self.progress.default_timeout, f"new_group({members})")
        mpi_group = world.Get_group()
        try:
            sub_group = mpi_group.Incl(members)
            comm = world.Create(sub_group)  # MPI_COMM_NULL outside the group
            sub_group.Free()
        finally:
            mpi_group.Free()
        if comm == self._MPI.COMM_NULL:
            return Communicator(None, members)
        self._groups.append(comm)
        return Communicator(comm, members)

    def supports_device(self, device: torch.device) -> bool:
        # CUDA tensors are accepted either way: passed to a CUDA-aware MPI, or staged here
        # through pinned host memory (staging them in the caller would pick the GPU again).
        return device.type in ("cpu", "cuda")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.progress.stop()
        for comm in self._groups:
            comm.Free()
        self._groups.clear()
        self._world.comm.Free()
        self.staging.pool.clear()

    def shrink(self) -> MPIBackend:
        """After a rank of this world failed: an engine on the ranks alive (ULFM, Open MPI 5
        under `mpiexec --with-ft ulfm`; `rank_failed` tells such a failure). Revokes the world
        communicator, so every survivor still waiting in it fails at once, shrinks it
        (`MPIX_Comm_shrink`: the survivors, renumbered in their old order; when that takes
        longer than the timeout, as it does while a rank that has not failed stays out, this
        process ends, saying so) and moves the exit barrier onto the shrunk one. The new
        engine's `previous` holds each of its ranks' rank in this world. This engine stops
        without freeing its communicators (freeing one would wait for the lost rank); its
        groups are gone with it. Collective over the survivors."""
        comm = self._world.comm
        comm.Revoke()
        timeout = self.progress.default_timeout
        # Blocking: Open MPI 5.0.11's MPIX_Comm_ishrink failed here (MPI_ERR_INTERN).
        with mpi_exit.deadline(timeout, f"rank {self.rank}: shrinking the MPI world of "
                               f"{self.size} after a rank failed did not finish within "
                               f"{timeout:g} s: a rank that has not failed is not taking part "
                               "(stopped or hung?); ending this rank"):
            shrunk = comm.Shrink()
        self.progress.stop()
        self._closed = True
        mpi_exit.adopt(shrunk)
        old, new = comm.Get_group(), shrunk.Get_group()
        try:
            previous = self._MPI.Group.Translate_ranks(new, list(range(new.Get_size())), old)
        finally:
            old.Free()
            new.Free()
        engine = MPIBackend(self._MPI, shrunk, timeout,
                            "thread" if self.progress.threaded else "none")
        engine.previous = tuple(previous)
        return engine


def rank_failed(error: BaseException | None) -> bool:
    """Whether `error` (a tandem operation's, or its cause) is ULFM's word that a peer failed
    (MPI_ERR_PROC_FAILED) or that a survivor revoked the communicator (MPI_ERR_REVOKED): then
    `MPIBackend.shrink` can go on without the lost rank. Other MPIs: never."""
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    failed = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                              "ERR_REVOKED") if hasattr(MPI, name)}
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MPI.Exception) and error.Get_error_class() in failed:
            return True
        error = error.__cause__ or error.__context__
    return False


def _collective(name: str, tensor, me: int, handle: Communicator, op=None,
                root=None) -> tuple[str, str]:
    """(what a collective was, who it waited for), for its timeout or failure message."""
    details = []
    if tensor is not None:
        details.append(f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}")
    if op is not None:
        details.append(op)
    if root is not None:
        details.append(f"root={root}")
    return (
        f"{name}({', '.join(details)}) on rank {me} with ranks {list(handle.ranks)}",
        f"one of ranks {handle.peers(me)} has not joined it (every member must make the "
        "same collective calls in the same order)",
    )


def _point_to_point(kind: str, nbytes: int, me: int, peer: int, tag: int) -> tuple[str, str]:
    if kind == "send":
        return (f"send of {nbytes} bytes from rank {me} to rank {peer} (tag {tag})",
                f"rank {peer} has not received it (no matching recv(src={me}, tag={tag}))")
    return (f"recv of {nbytes} bytes on rank {me} from rank {peer} (tag {tag})",
            f"rank {peer} has not sent it (no matching send(dst={me}, tag={tag}))")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share memory (MPI takes no aliased send and receive buffers)."""
    if a.device != b.device or not a.nbytes or not b.nbytes:
        return False
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def _steps(*after):
    """The copy-back steps that exist (most operations have none)."""
    return tuple(step for step in after if step is not None) if any(after) else ()


def _counts(splits: Sequence[int], row_bytes: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements for `Alltoallv`, from row counts."""
    counts = [int(s) * row_bytes for s in splits]
    displacements, offset = [], 0
    for count in counts:
        displacements.append(offset)
        offset += count
    return counts, displacements
