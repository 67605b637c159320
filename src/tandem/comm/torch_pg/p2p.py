"""Point-to-point messages of tandem's process group carry what was sent: a receive into a
tensor of another size or dtype is an error at the receiver, never stale values or bytes read
as another dtype.

MPI and Gloo both accept a message shorter than the receive (the rest of the tensor keeps its
old values) and neither knows dtypes. So `send` first sends a header of a few int64 (the
number of elements, the dtype, the shape) with the same tag, and `recv` receives it ahead of
the data (MPI keeps the order of messages with one tag between two ranks; so does Gloo); its
`wait()` compares it with the tensor it receives into and raises `MessageMismatchError`
naming the sender, what it sent and what was expected. Not on NCCL: the header would have to
be read on the host, a synchronisation per message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement.agree import CollectiveMismatchError
from tandem.comm.engines.backend import Work

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
           torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)
_SHAPE_SLOTS = 5
HEADER_LEN = 3 + _SHAPE_SLOTS  # numel, dtype, ndim, the first dims


class MessageMismatchError(CollectiveMismatchError):
    """A receive whose tensor does not fit what its sender sent (size or dtype)."""


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + agreement.checksum(str(dtype))


def header(tensor: torch.Tensor) -> torch.Tensor:
    """The few int64 a point-to-point message carries ahead of its data: what was sent."""
    shape = list(tensor.shape)[:_SHAPE_SLOTS]
    values = [tensor.numel(), _dtype_code(tensor.dtype), tensor.dim(), *shape]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def _said(numel: int, code: int, ndim: int, dims: list[int]) -> str:
    dtype = str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "?"
    shape = dims[:ndim] + (["..."] if ndim > _SHAPE_SLOTS else [])
    text = ", ".join(map(str, shape)) + ("," if ndim == 1 else "")
    return f"{numel} elements of {dtype} (shape ({text}))"


def check_header(received: torch.Tensor, tensor: torch.Tensor, me: int, src: int, tag: int) -> None:
    """Raise `MessageMismatchError` unless the message from `src` fits `tensor`."""
    numel, code, ndim, *dims = received.tolist()
    if numel == tensor.numel() and code == _dtype_code(tensor.dtype):
        return
    expected = _said(tensor.numel(), _dtype_code(tensor.dtype), tensor.dim(),
                     list(tensor.shape)[:_SHAPE_SLOTS])
    raise MessageMismatchError(
        f"recv on rank {me} from rank {src} (tag {tag}): rank {src} sent "
        f"{_said(numel, code, ndim, dims)}, but this rank expected {expected}; the tensor's "
        "contents are unspecified. Receive into a tensor of the sent size and dtype (send the "
        "size first when it varies, or use send_object_list / recv_object_list)")


def carries_headers(engine: Any) -> bool:
    """Whether messages carry a header: not on NCCL, where reading it would synchronise."""
    return engine.supports_device(torch.device("cpu"))


def send(engine: Any, tensor: torch.Tensor, buffer: torch.Tensor, dst: int, tag: int,
         group: Any) -> list[Work]:
    """Send `buffer` (the wire's copy of `tensor`) to global rank `dst`, its header first."""
    works = []
    if carries_headers(engine):
        works.append(engine.send(header(tensor), dst, tag, group))
    works.append(engine.send(buffer, dst, tag, group))
    return works


def recv(engine: Any, tensor: torch.Tensor, buffer: torch.Tensor, src: int, tag: int,
         group: Any, timeout: float) -> tuple[Work, Callable[[], None] | None]:
    """Receive into `buffer` from global rank `src`: (the data's work, the header's check)."""
    check = None
    if carries_headers(engine):
        said = torch.empty(HEADER_LEN, dtype=torch.int64)
        head = engine.recv(said, src, tag, group)

        def check() -> None:
            head.wait(timeout)
            check_header(said, tensor, engine.rank, src, tag)
    return engine.recv(buffer, src, tag, group), check
