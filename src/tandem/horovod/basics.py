"""Horovod's basics: init and the world, build queries, error types, process sets, ops, compression.

Process sets are Horovod's sub-communicators; each is a `td.new_group` underneath. As in
Horovod, `add_process_set` and `remove_process_set` are collective: every rank calls them, in
the same order.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

import tandem as td
from tandem.comm.agreement.agree import CollectiveMismatchError
from tandem.comm.groups import Group
from tandem.elastic.state import WorldChanged

# Reduction ops, Horovod's names for tandem's.
Average = "mean"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
Adasum = "adasum"  # accepted by name; every op that meets it says it is not implemented
_OPS = (Average, Sum, Min, Max, Product)


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name; elastic scripts catch it)."""


# Horovod's elastic signal that the hosts changed: `State.commit()` raises it (`td.elastic`).
HostsUpdatedInterrupt = WorldChanged


class HorovodMismatchError(CollectiveMismatchError, RuntimeError):
    """Ranks called a collective with different shapes, dtypes, roots or ops.

    Horovod raises a RuntimeError there; tandem a `CollectiveMismatchError` (a ValueError).
    This is both, so `except RuntimeError` (Horovod scripts) and `except
    td.CollectiveMismatchError` (tandem code) both catch it.
    """


def init(comm: Any = None, process_sets: Sequence[Any] | None = None) -> None:
    """Join the job (`td.init()`); `process_sets` (lists of ranks) are added right away.

    `comm` (an mpi4py communicator, or a list of ranks, in Horovod) is not supported: tandem's
    world is the job's; make sub-groups with `add_process_set`.
    """
    if comm is not None:
        raise ValueError(
            f"tandem.horovod.init(comm={comm!r}) is not supported: the world is the whole job; "
            "use hvd.add_process_set(ranks) for a subset"
        )
    td.init()
    for process_set in process_sets or ():
        add_process_set(process_set)


def shutdown() -> None:
    global_process_set._forget_sets()
    td.shutdown()


def is_initialized() -> bool:
    return td.is_initialized()


def rank() -> int:
    return td.rank()


def size() -> int:
    return td.size()


def local_rank() -> int:
    return td.local_rank()


def local_size() -> int:
    return td.local_size()


def cross_rank() -> int:
    """Which node this rank is on (ranks are laid out node by node)."""
    return td.rank() // td.local_size()


def cross_size() -> int:
    """How many nodes the job spans."""
    return td.size() // td.local_size()


def is_homogeneous() -> bool:
    """Every node runs the same number of ranks (tandem's launcher lays them out so)."""
    return td.size() % td.local_size() == 0


# -- build and feature queries: what this tandem offers, in Horovod's terms ------------------
def mpi_built() -> bool:
    """MPI is available (tandem reaches it through mpi4py)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    """Horovod returns NCCL's version number here, 0 without NCCL; tandem leaves NCCL to torch."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def mpi_enabled() -> bool:
    """The job's collectives run over MPI (`--backend mpi`, or started by mpiexec)."""
    from tandem import runtime

    return runtime.is_initialized() and runtime.get_backend().name == "mpi"


def gloo_enabled() -> bool:
    from tandem import runtime

    return runtime.is_initialized() and runtime.get_backend().name == "gloo"


def mpi_threads_supported() -> bool:
    return mpi_enabled()


def gpu_available(ext_base_name: str = "torch", verbose: bool = False) -> bool:
    return torch.cuda.is_available()


# -- process sets -----------------------------------------------------------------------------
class ProcessSet:
    """A set of ranks that run collectives among themselves (a `td.new_group`).

    `ProcessSet([0, 2])` only describes it; `add_process_set` (every rank calls it) makes it
    usable. `global_process_set` is the whole world.
    """

    def __init__(self, ranks: Sequence[int] | None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self.group: Group | None = None

    def _check(self) -> None:
        if self.process_set_id is None:
            raise ValueError(
                f"{self} is not registered: call hvd.add_process_set(...) on every rank first "
                "(or it was removed with hvd.remove_process_set)"
            )

    def size(self) -> int | None:
        if self.process_set_id is None:
            return None
        return td.size() if self.group is None else self.group.size

    def rank(self) -> int | None:
        """This process's rank within the set (-1 outside it)."""
        if self.process_set_id is None:
            return None
        return td.rank() if self.group is None else self.group.rank

    def included(self) -> bool | None:
        if self.process_set_id is None:
            return None
        return self.group is None or self.group.rank >= 0

    def __str__(self) -> str:
        ranks = "all ranks" if self.group is None and self.process_set_id == 0 else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    def __init__(self) -> None:
        super().__init__(None)
        self.process_set_id = 0
        self._sets: dict[int, ProcessSet] = {}
        self._next_id = 1

    def _forget_sets(self) -> None:
        for process_set in self._sets.values():
            process_set.process_set_id = None
            process_set.group = None
        self._sets.clear()
        self._next_id = 1


global_process_set = _GlobalProcessSet()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (collective) and return it."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    if process_set.ranks is None:
        raise ValueError("a process set needs a list of ranks, e.g. hvd.add_process_set([0, 1])")
    for registered in global_process_set._sets.values():
        if registered.ranks == process_set.ranks:
            raise ValueError(
                f"a process set with ranks {process_set.ranks} is already registered "
                f"({registered}); use that one"
            )
    process_set.group = td.new_group(process_set.ranks)
    process_set.process_set_id = global_process_set._next_id
    global_process_set._sets[process_set.process_set_id] = process_set
    global_process_set._next_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective); False for the global set or an unknown one."""
    if process_set.process_set_id in (None, 0):
        return False
    if global_process_set._sets.pop(process_set.process_set_id, None) is None:
        return False
    td.barrier()  # every rank removes it at the same point, as every rank added it
    process_set.process_set_id = None
    process_set.group = None
    return True


def group_of(process_set: ProcessSet | None) -> Group | None:
    """The tandem group behind a process set (None: the world); checks it may be used here."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    process_set._check()
    if not process_set.included():
        raise ValueError(
            f"rank {td.rank()} is not in {process_set}: only its members may use it"
        )
    return process_set.group


def reduce_op(average: bool | None, op: str | None, default: str = Average) -> str:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated in Horovod) or op=, not both")
    if average is not None:
        return Average if average else Sum
    op = default if op is None else op
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented in tandem.horovod: use hvd.Average or hvd.Sum"
        )
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


# -- compression ------------------------------------------------------------------------------
class Compressor:
    """Horovod's interface: `compress(t) -> (t', ctx)`, `decompress(t', ctx) -> t`."""

    wire: str | None = None  # the name td.DistributedOptimizer knows it by

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class _CastCompressor(Compressor):
    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or not ctx.is_floating_point else tensor.type(ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire = "fp16"
    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16."""

    wire = "bf16"
    dtype = torch.bfloat16


class Compression:
    """Wire compression: `Compression.none`, `Compression.fp16`, `Compression.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def compressor(compression: Any) -> type[Compressor]:
    """A compressor class for Horovod's objects and tandem's names ("fp16", None)."""
    if compression is None:
        return NoneCompressor
    if isinstance(compression, str):
        for known in (FP16Compressor, BF16Compressor):
            if known.wire == compression:
                return known
        raise ValueError(f"unknown compression {compression!r}: use hvd.Compression.fp16 or .none")
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return compression
    raise TypeError(f"compression must be a hvd.Compression member, got {compression!r}")
