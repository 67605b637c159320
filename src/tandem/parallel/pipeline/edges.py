"""What crosses a pipeline edge, and how: edge specs and point-to-point links with deadlines.

A stage's output is a tensor or a tuple/list of tensors. It travels as one message per tensor;
the receiver has to know the shapes and dtypes to post its receives, so the sender describes
the edge once in an `EdgeSpec` (a fixed-size int64 message) and both sides cache it. Gradients
travel back along the same edge, one message per floating-point tensor, with the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.comm.collectives import direct
from tandem.comm.engines.backend import Backend, Work

#: int64 words in a packed spec: container, count, then (dtype, ndim, *dims) per tensor.
SPEC_WORDS = 256
#: Tensors one edge may carry (tags are laid out with this stride).
MAX_TENSORS = 64

_CONTAINERS = ("tensor", "tuple", "list")
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)

# Message tags. Gloo and MPI match messages in order per (peer, tag), so tags need only tell
# apart the messages that can be in flight together within one step: one per (micro-batch,
# direction, tensor), plus the per-step header.
HEADER_TAG = 1
_TAG_BASE = 16
_ACT, _GRAD, _SPEC = 0, 1, 2


def tag(direction: int, microbatch: int, index: int = 0) -> int:
    return _TAG_BASE + (microbatch * 3 + direction) * MAX_TENSORS + index


def act_tag(microbatch: int, index: int) -> int:
    return tag(_ACT, microbatch, index)


def grad_tag(microbatch: int, index: int) -> int:
    return tag(_GRAD, microbatch, index)


def spec_tag(microbatch: int) -> int:
    return tag(_SPEC, microbatch)


@dataclass(frozen=True)
class EdgeSpec:
    """The structure, shapes and dtypes of one micro-batch's activation on one edge."""

    container: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def describe(cls, value, stage: int) -> tuple[EdgeSpec, list[torch.Tensor]]:
        """The spec of a stage output and its tensors; a clear error for what cannot travel."""
        if isinstance(value, torch.Tensor):
            container, tensors = "tensor", [value]
        elif isinstance(value, (tuple, list)):
            container, tensors = type(value).__name__, list(value)
            odd = [f"[{k}] {type(t).__name__}" for k, t in enumerate(tensors)
                   if not isinstance(t, torch.Tensor)]
            if odd:
                raise TypeError(
                    f"stage {stage} returned a {container} with non-tensor items ({', '.join(odd)}): "
                    f"only tensors can cross a pipeline edge; return constants from a later stage "
                    f"or encode them as tensors"
                )
            if not 1 <= len(tensors) <= MAX_TENSORS:
                raise TypeError(
                    f"stage {stage} returned a {container} of {len(tensors)} tensors: an edge "
                    f"carries 1 to {MAX_TENSORS}"
                )
        else:
            raise TypeError(
                f"stage {stage} returned {type(value).__name__}: a pipeline stage must return a "
                f"tensor or a tuple/list of tensors"
            )
        bad = [t.dtype for t in tensors if t.dtype not in _DTYPES]
        if bad:
            raise TypeError(f"stage {stage} returned tensors of unsupported dtype {bad}")
        spec = cls(container, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors))
        return spec, tensors

    def pack(self) -> torch.Tensor:
        words = [_CONTAINERS.index(self.container), len(self.shapes)]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            words += [_DTYPES.index(dtype), len(shape), *shape]
        if len(words) > SPEC_WORDS:
            raise ValueError(
                f"a pipeline edge of {len(self.shapes)} tensors with shapes {self.shapes} needs "
                f"{len(words)} words to describe, over the limit of {SPEC_WORDS}"
            )
        return torch.tensor(words + [0] * (SPEC_WORDS - len(words)), dtype=torch.int64)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> EdgeSpec:
        words = packed.tolist()
        container, count, pos = _CONTAINERS[words[0]], words[1], 2
        shapes, dtypes = [], []
        for _ in range(count):
            dtype, ndim = _DTYPES[words[pos]], words[pos + 1]
            shapes.append(tuple(words[pos + 2 : pos + 2 + ndim]))
            dtypes.append(dtype)
            pos += 2 + ndim
        return cls(container, tuple(shapes), tuple(dtypes))

    @property
    def floating(self) -> list[int]:
        """Indices of the tensors that carry a gradient back."""
        return [k for k, d in enumerate(self.dtypes) if d.is_floating_point or d.is_complex]

    def build(self, tensors: list[torch.Tensor]):
        if self.container == "tensor":
            return tensors[0]
        return tuple(tensors) if self.container == "tuple" else list(tensors)


class Link:
    """Asynchronous sends and receives to pipeline neighbours, each wait under a deadline.

    Sends are fire-and-forget until `flush` (their tensors are kept alive until then);
    receives return a `Pending` the consumer waits on. Tensors on a device the engine cannot
    use directly (CUDA over Gloo) are staged through the CPU.
    """

    def __init__(self, backend: Backend, group, timeout: float, describe) -> None:
        self.backend = backend
        self.group = group
        self.timeout = timeout
        self._describe = describe  # global rank -> "stage s (rank r)"
        self._sends: list[tuple[Work, torch.Tensor, str]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        work, buffer = direct.send(tensor.detach().contiguous(), peer, tag, self.group)
        self._sends.append((work, buffer, f"{what} to {self._describe(peer)}"))
        if len(self._sends) > 32:  # drop finished sends so their tensors can be freed
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def recv(self, shape, dtype, device: torch.device, peer: int, tag: int, what: str) -> Pending:
        target = torch.empty(shape, dtype=dtype, device=device)
        work, buffer = direct.recv(target, peer, tag, self.group)
        return Pending(work, buffer, target, f"{what} from {self._describe(peer)}", self)

    def flush(self) -> None:
        """Wait for every send of this step."""
        sends, self._sends = self._sends, []
        for work, _, what in sends:
            _wait(work, self.timeout, f"sending {what}", self._describe(None))

    def abandon(self) -> None:
        self._sends = []


class Pending:
    """A posted receive."""

    def __init__(self, work: Work, buffer, target, what: str, link: Link) -> None:
        self.work, self.buffer, self.target, self.what, self.link = work, buffer, target, what, link

    def wait(self) -> torch.Tensor:
        _wait(self.work, self.link.timeout, f"receiving {self.what}", self.link._describe(None))
        if self.buffer is not self.target:
            self.target.copy_(self.buffer)
        return self.target


def _wait(work: Work, timeout: float, what: str, me: str) -> None:
    try:
        work.wait(timeout)
    except TimeoutError as error:
        raise TimeoutError(
            f"pipeline {me} waited {timeout:g} s (the timeout) {what} and gave up: that rank "
            f"failed, is stuck, or runs a different number of train_step/forward calls"
        ) from error
