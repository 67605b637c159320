"""How tensors travel through MPI: datatypes, zero-copy views, and stand-ins for what MPI lacks.

A CPU tensor goes to MPI as a raw address and a count (no copy, no NumPy), so every dtype
moves, bfloat16 included. Data movement (broadcast, gather, all-to-all, send/recv) always
travels as bytes. Reductions need a datatype MPI can add: float16 and bfloat16 are reduced
in float32 and bool in int32, through stand-in buffers taken from a pool, because MPICH has no
bfloat16 type and its float16 reduction is software emulated (13x slower than float32 on a
16 MB buffer here, more than the two casts cost). A CUDA tensor is passed straight through
when the MPI library is CUDA-aware (`cuda_aware()`), else staged through pinned host memory.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch

from tandem.job import settings

# Reduced in a wider dtype: what MPI (or MPICH at speed) cannot reduce natively.
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32}

# MPI's name for each dtype it reduces natively.
_MPI_NAMES = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE",
    torch.int8: "INT8_T", torch.int16: "INT16_T", torch.int32: "INT32_T", torch.int64: "INT64_T",
    torch.uint8: "UINT8_T",
    torch.complex64: "C_FLOAT_COMPLEX", torch.complex128: "C_DOUBLE_COMPLEX",
}

_POOL_DEPTH = 4  # free buffers kept per (dtype, size, device); more in flight are allocated
_EMPTY = bytearray(1)  # the address handed to MPI for zero-byte messages


def reduction_types(MPI: Any) -> dict[torch.dtype, Any]:
    """torch dtype -> the MPI datatype its (possibly widened) reduction uses."""
    return {dtype: getattr(MPI, name) for dtype, name in _MPI_NAMES.items()}


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of `dtype` runs in."""
    return _WIDER.get(dtype, dtype)


def row_elements(tensor: torch.Tensor) -> int:
    """Elements in one dim-0 row (1 for a 0-d tensor)."""
    return math.prod(tensor.shape[1:]) if tensor.dim() else 1


def _libmpi_function(name: str) -> Callable[[], int] | None:
    """A symbol of the MPI library this process loaded, if it exports it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        return function
    return None


def cuda_aware() -> bool:
    """Whether MPI can read and write CUDA memory directly.

    `TANDEM_MPI_CUDA_AWARE=1/0` decides when set; otherwise the library is asked through the
    `MPIX_Query_cuda_support()` extension that MPICH and Open MPI both export (MPICH answers
    1 only when its GPU support is enabled at run time). Unknown means no: staging through
    host memory is slower, but never wrong.
    """
    forced = settings.current().mpi_cuda_aware
    if forced is not None:
        return forced
    if not torch.cuda.is_available():
        return False
    query = _libmpi_function("MPIX_Query_cuda_support")
    try:
        return bool(query and query() == 1)
    except OSError:
        return False


class BufferPool:
    """Reusable stand-in buffers, so a steady training loop allocates nothing per step.

    A buffer is taken for the life of one operation and given back when it completes, so
    several operations of the same size in flight each get their own.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        pinned = device.type == "cpu" and torch.cuda.is_available()
        free = self._free.get((dtype, numel, device, pinned))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pinned)

    def give(self, buffer: torch.Tensor) -> None:
        pinned = buffer.device.type == "cpu" and buffer.is_pinned()
        free = self._free.setdefault((buffer.dtype, buffer.numel(), buffer.device, pinned), [])
        if len(free) < _POOL_DEPTH:
            free.append(buffer)

    def clear(self) -> None:
        self._free.clear()


class Staging:
    """Turns tensors into MPI buffer specs, and knows what to copy back when an op is done.

    `spec(tensor, reduce, copy_in, copy_out)` returns `[address, count, datatype]` and, when a
    stand-in buffer was needed, a callable that copies the result back (if `copy_out`) and
    returns the buffer to the pool. The tensor must stay alive until that has run.
    """

    def __init__(self, MPI: Any, cuda_aware: bool) -> None:
        self._MPI = MPI
        self._fromaddress = self.fromaddress = MPI.buffer.fromaddress
        self._byte = MPI.BYTE
        self._types = reduction_types(MPI)
        self.cuda_aware = cuda_aware
        self.pool = BufferPool()

    def _address(self, tensor: torch.Tensor, nbytes: int):
        if nbytes == 0:
            return _EMPTY
        return self._fromaddress(tensor.data_ptr(), nbytes)

    def spec(
        self, tensor: torch.Tensor, reduce: bool, copy_in: bool = True, copy_out: bool = True
    ) -> tuple[list, Callable[[], None] | None]:
        if not tensor.is_contiguous():
            raise ValueError(
                f"the MPI backend needs contiguous tensors; got shape {tuple(tensor.shape)} "
                f"with strides {tensor.stride()}: pass tensor.contiguous()"
            )
        if tensor.is_cuda:
            return self._cuda(tensor, reduce, copy_in, copy_out)
        if not reduce:
            nbytes = tensor.nbytes
            return [self._address(tensor, nbytes), nbytes, self._byte], None
        datatype = self._types.get(tensor.dtype)
        if datatype is not None and tensor.numel():  # the common case, kept short (every message)
            return [self._fromaddress(tensor.data_ptr(), tensor.nbytes), tensor.numel(), datatype], None
        if datatype is not None:
            return [_EMPTY, 0, datatype], None
        return self._staged(tensor, self._wider(tensor.dtype), reduce, copy_in, copy_out)

    def _cuda(self, tensor, reduce, copy_in, copy_out):
        wide = self._wider(tensor.dtype) if reduce else tensor.dtype
        if wide is tensor.dtype and self.cuda_aware:
            # MPI knows nothing of CUDA streams: the data must be there before it reads.
            torch.cuda.current_stream(tensor.device).synchronize()
            return self._spec_of(tensor, reduce), None
        return self._staged(tensor, wide, reduce, copy_in, copy_out)

    def _wider(self, dtype: torch.dtype) -> torch.dtype:
        if dtype in self._types:
            return dtype
        wide = _WIDER.get(dtype)
        if wide is None:
            raise TypeError(
                f"the MPI backend cannot reduce {dtype}: use one of "
                f"{', '.join(str(d).replace('torch.', '') for d in (*self._types, *_WIDER))}"
            )
        return wide

    def _spec_of(self, buffer: torch.Tensor, reduce: bool) -> list:
        nbytes = buffer.nbytes
        if not reduce:
            return [self._address(buffer, nbytes), nbytes, self._byte]
        return [self._address(buffer, nbytes), buffer.numel(), self._types[buffer.dtype]]

    def _staged(self, tensor, wide, reduce, copy_in, copy_out):
        device = tensor.device if tensor.is_cuda and self.cuda_aware else torch.device("cpu")
        buffer = self.pool.take(wide, tensor.numel(), device)
        flat = tensor.view(-1)
        if copy_in:
            buffer.copy_(flat)  # a cast, a device-to-host copy, or both; synchronous
        if buffer.device.type == "cuda":
            torch.cuda.current_stream(buffer.device).synchronize()
        pool = self.pool

        def finish() -> None:
            if copy_out:
                flat.copy_(buffer)
            pool.give(buffer)

        return self._spec_of(buffer, reduce), finish
