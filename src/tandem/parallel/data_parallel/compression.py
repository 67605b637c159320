"""Gradient compression: communication hooks that send fewer bytes, and `compression=` names.

    td.DistributedOptimizer(opt, compression="bf16")                 # or "fp16", "powersgd"
    td.DistributedOptimizer(opt, compression=PowerSGD(rank=4, start_iter=0))

Each is a hook of the contract in `tandem.parallel.data_parallel.comm_hooks` (a `GradBucket` in, a `Work`
out, the group's sum in the buffer once waited for); `make_comm_hook` turns a `compression=`
argument into one.

- "fp16" / "bf16": the buffer is cast into a low-precision copy (allocated once per bucket),
  that copy is all-reduced, and the result cast back: half the bytes on the wire. The
  gradients were already divided by the group size (op="mean"), so fp16 sums do not overflow
  where the mean would not. bf16 keeps fp32's range with 8 bits of mantissa: each element of
  the averaged gradient is off by up to ~0.4 % of its value.
- "powersgd" (Vogels et al., 2019): each weight matrix M (n x m; convolutions as
  out x in*k*k) is sent as two thin factors P = M Q (n x r) and Q = M^T P (m x r), all-reduced
  one after the other with P orthogonalised in between; the gradient becomes P Q^T. Each rank
  keeps what the approximation missed (error feedback) and adds it to its next gradient, and Q
  is reused from step to step (warm start), so rank 1 to 4 trains close to full precision.
  Vectors (biases, norms), matrices too small to gain and the used flags are all-reduced
  uncompressed. The first `start_iter` rounds are uncompressed too, as in PyTorch's hook.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.comm.engines.backend import Work
from tandem.parallel.data_parallel.comm_hooks import CommHook, GradBucket, allreduce_hook

NAMES = ("none", "fp16", "bf16", "powersgd")


class _CastBackWork(Work):
    """All-reduce of a low-precision copy; waiting copies the sum back into the bucket."""

    def __init__(self, work: Work, low: torch.Tensor, out: torch.Tensor) -> None:
        self._work, self._low, self._out, self._done = work, low, out, False

    def wait(self, timeout: float | None = None) -> None:
        self._work.wait(timeout)
        if not self._done:
            self._out.copy_(self._low)
            self._done = True

    def is_completed(self) -> bool:
        return self._work.is_completed()


class CastHook:
    """Reduce in `dtype` (torch.float16 or torch.bfloat16) on the wire."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastHook casts to float16 or bfloat16, not {dtype}")
        self.dtype = dtype

    def __call__(self, bucket: GradBucket) -> Work:
        if bucket.buffer.dtype == self.dtype or not bucket.buffer.is_floating_point():
            return allreduce_hook(bucket)
        low = bucket.state.get("cast")
        if low is None:
            low = bucket.state["cast"] = torch.empty_like(bucket.buffer, dtype=self.dtype)
        low.copy_(bucket.buffer)
        work = bucket.backend.allreduce(low, "sum", bucket.group)
        return _CastBackWork(work, low, bucket.buffer)

    def __repr__(self) -> str:
        return f"CastHook({str(self.dtype).replace('torch.', '')})"


class _PowerSGDState:
    """One bucket's factors, error feedback and staging buffers, built on first use."""

    def __init__(self, bucket: GradBucket, rank: int, min_rate: float, seed: int) -> None:
        self.rounds = 0
        self.matrices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        rest: list[torch.Tensor] = []
        shapes = []
        for view in bucket.views:
            n = view.shape[0] if view.dim() >= 2 else 0
            m = view.numel() // n if n else 0
            r = min(rank, n, m)
            if view.dim() >= 2 and n * m > min_rate * r * (n + m):
                shapes.append((view, n, m, r))
            else:
                rest.append(view.view(-1))
        rest.append(bucket.tail)
        self.rest = rest
        self.rest_buffer = torch.empty(sum(t.numel() for t in rest), dtype=bucket.buffer.dtype,
                                       device=bucket.buffer.device)
        kw: dict[str, Any] = {"dtype": bucket.buffer.dtype, "device": bucket.buffer.device}
        self.p_flat = torch.empty(sum(n * r for _, n, _, r in shapes), **kw)
        self.q_flat = torch.empty(sum(m * r for _, _, m, r in shapes), **kw)
        generator = torch.Generator().manual_seed(seed + 7919 * bucket.index)
        p_at = q_at = 0
        for view, n, m, r in shapes:
            p = self.p_flat[p_at : p_at + n * r].view(n, r)
            q = self.q_flat[q_at : q_at + m * r].view(m, r)
            # The same random start on every rank (seeded), so the factors agree.
            q.copy_(torch.randn(m, r, generator=generator, dtype=torch.float32))
            self.matrices.append((view.view(n, m), p, q, torch.zeros(n, m, **kw)))
            p_at, q_at = p_at + n * r, q_at + m * r


class _PowerSGDWork(Work):
    """Phase two of PowerSGD, run on wait(): orthogonalise P, reduce Q, decompress."""

    def __init__(self, state: _PowerSGDState, bucket: GradBucket, p_work: Work, rest_work: Work):
        self._state, self._bucket, self._p_work, self._rest_work = state, bucket, p_work, rest_work
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        state, bucket = self._state, self._bucket
        self._p_work.wait(timeout)
        for matrix, p, q, _ in state.matrices:
            # P is the same on every rank (it was just all-reduced), so its Q factor is too.
            p.copy_(torch.linalg.qr(p).Q)
            torch.matmul(matrix.t(), p, out=q)
        bucket.backend.allreduce(state.q_flat, "sum", bucket.group).wait(timeout)
        share = 1.0 / bucket.size
        for matrix, p, q, error in state.matrices:
            error.copy_(matrix)  # this rank's gradient (plus last error)...
            torch.matmul(p, q.t(), out=matrix)  # ...becomes the approximated group sum
            # ...and the error keeps what this rank's share of the sum missed.
            error.add_(matrix, alpha=-share)
        self._rest_work.wait(timeout)
        at = 0
        for segment in state.rest:
            segment.copy_(state.rest_buffer[at : at + segment.numel()])
            at += segment.numel()
        self._done = True

    def is_completed(self) -> bool:
        return self._done


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback and warm start (a communication hook).

    `start_iter`: rounds reduced uncompressed first (PyTorch's default 10); `min_compression`:
    a matrix is compressed only when that shrinks it at least this many times.
    """

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression: float = 2.0,
                 seed: int = 0) -> None:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an integer >= 1 (1 to 4 is typical), got {rank!r}")
        if start_iter < 0:
            raise ValueError(f"PowerSGD start_iter must be >= 0, got {start_iter}")
        self.rank, self.start_iter, self.min_compression, self.seed = rank, start_iter, min_compression, seed

    def __call__(self, bucket: GradBucket) -> Work:
        state: _PowerSGDState | None = bucket.state.get("powersgd")
        if state is None:
            state = bucket.state["powersgd"] = _PowerSGDState(
                bucket, self.rank, self.min_compression, self.seed)
        state.rounds += 1
        if state.rounds <= self.start_iter or not state.matrices:
            return allreduce_hook(bucket)
        backend = bucket.backend
        at = 0
        for segment in state.rest:
            state.rest_buffer[at : at + segment.numel()].copy_(segment.view(-1))
            at += segment.numel()
        rest_work = backend.allreduce(state.rest_buffer, "sum", bucket.group)
        for matrix, p, q, error in state.matrices:
            if bucket.contributing:
                matrix.add_(error)  # error feedback
            else:
                error.zero_()  # a joined rank adds nothing, and remembers nothing
            torch.matmul(matrix, q, out=p)
        p_work = backend.allreduce(state.p_flat, "sum", bucket.group)
        return _PowerSGDWork(state, bucket, p_work, rest_work)

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, start_iter={self.start_iter})"


def make_comm_hook(compression: str | CommHook | None) -> CommHook:
    """The hook for a `compression=` argument: None, a name in NAMES, or a hook itself."""
    if compression is None or compression == "none":
        return allreduce_hook
    if isinstance(compression, str):
        if compression == "fp16":
            return CastHook(torch.float16)
        if compression == "bf16":
            return CastHook(torch.bfloat16)
        if compression == "powersgd":
            return PowerSGD()
        raise ValueError(
            f"unknown compression {compression!r}: choose one of {', '.join(NAMES)}, "
            f"or pass a hook such as PowerSGD(rank=2)"
        )
    if callable(compression):
        return compression
    raise TypeError(f"compression must be None, a name or a hook, not {type(compression).__name__}")
