"""What tandem's process group adds so that torch.distributed never returns garbage: collectives
completed in order, checks that travel with asynchronous work, and one agreement per backward.

- In order (`InOrder`): Gloo runs a group's collectives one after another on its worker
  thread, so a `dist.barrier()` (or any later collective) returns after every earlier one has
  completed, waited for or not. MPI moves a request only while someone tests it, and
  completes non-blocking collectives in any order: an `all_reduce(async_op=True)` never waited
  for was still half reduced after a barrier. Here every collective `Work` of a group joins its
  queue; waiting for one first finishes the earlier ones, in order, and a blocking call (a
  barrier) finishes them all before it returns. Point-to-point work stays out (Gloo's barrier
  does not wait for a receive either).
- Asynchronous checks (`post_check`): a blocking call from torch's Python API is checked
  before it sends (`comm.agreement.checks`: one small agreement). An `async_op=True` call must not wait
  on the issuing thread, so the same agreement message (the same codes) is posted with the
  work, and its answer is read at `wait()`: ranks that passed different shapes, dtypes or ops
  raise there, each rank's call named, and the (garbage) result is never handed over.
- Rounds (`Rounds`): torch's DDP reduces its buckets through this group from C++, with no
  check (their shapes come from DDP's buckets). A rank that skips a backward and its step (the
  NaN-skip pattern) would train one step apart from the others. So the first reduction of each
  backward (one autograd graph task) posts one agreement beside the bucket, with what
  `parallel/operation_check.py` sends for tandem's own reducer: the round's number and the training
  forwards DDP ran on this group (counted by `count_ddp_forwards`' hook on DDP's forward). The
  rank that ran a forward without its backward is named at the next backward (raised by the
  bucket's `allreduce`, before it sends: DDP passes that on to `loss.backward()`). One message
  of a few hundred bytes per backward, not per bucket, read before the first bucket as
  tandem's reducer does (DDP's buckets complete as they are issued here anyway); not sent
  where it would be a host synchronisation (an engine without CPU tensors: NCCL), nor under
  torch's `Join` (joined ranks shadow the reductions without a backward of their own).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import checks, fingerprints
from tandem.comm.agreement.agree import CollectiveMismatchError, DivergedError

_HERE = os.path.dirname(__file__) + os.sep  # the frames of this folder: the process group's
_TORCH_API: str | None = None  # torch.distributed.distributed_c10d's file, once known


class InOrder:
    """The collective works of one group not yet finished, oldest first."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque = deque()

    def add(self, work: Any) -> None:
        self._queue.append(work)

    def finish_through(self, work: Any, timeout: float) -> None:
        """Finish every work queued before `work` (oldest first), and take `work` off."""
        queue = self._queue
        while queue:
            first = queue.popleft()
            if first is work:
                return
            first.finish_in_order(timeout)

    def ready(self, work: Any) -> bool:
        """Whether every work queued before `work` has completed (a poll: nothing waits)."""
        for earlier in list(self._queue):
            if earlier is work:
                return True
            if not earlier.is_completed():
                return False
        return True

    def finish_all(self, timeout: float) -> None:
        """Finish every queued work (a blocking collective is about to return)."""
        queue = self._queue
        while queue:
            queue.popleft().finish_in_order(timeout)


def from_python_api() -> bool:
    """Whether the process group's method was called by torch's Python API (`dist.all_reduce`,
    the user's own call) rather than from C++ (DDP's reducer, functional collectives)."""
    global _TORCH_API
    if _TORCH_API is None:
        import torch.distributed.distributed_c10d as c10d

        _TORCH_API = c10d.__file__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _TORCH_API


_ASYNC = agreement.checksum("asynchronous collective")
_CALLS: dict[tuple, tuple[str, list[int]]] = {}  # a call's description and codes, made once
_MOST_CALLS = 4096


def post_check(collective: str, tensor: torch.Tensor, group: Any, engine: Any,
               op: str | None = None, root: int | None = None,
               ignore_dim0: bool = False) -> list[Callable[[], None]]:
    """Send the argument check of an asynchronous call now (unless checks are off); the
    returned step reads its answer (at `wait()`) and raises `CollectiveMismatchError` naming
    every rank's call."""
    if not (engine.checks or engine.debug):
        return []
    key = (collective, tensor.shape, tensor.dtype, tensor.device.type, op, root, ignore_dim0)
    call = _CALLS.get(key)
    if call is None:
        if len(_CALLS) >= _MOST_CALLS:
            _CALLS.clear()
        text = checks.describe(collective, tensor, op, root, ignore_dim0)
        call = _CALLS[key] = (text, [_ASYNC, agreement.checksum(f"{text} {key[3]}")])
    posted = agreement.post(call[1], group, engine)
    site = fingerprints.site_key()  # the user's line, put into words only on a mismatch

    def mine() -> str:
        return f"{call[0]} (async_op=True) at {fingerprints.site_text(site)}"

    def finish() -> None:
        agreement.agree(mine, group, explain=_explain_async, engine=engine, posted=posted)
    return [finish]


def _explain_async(ranks, calls) -> str:
    lines = "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
    return ("ranks called a collective with different arguments; its result is garbage and "
            f"was not handed over (the check travelled with the work, read at wait()):\n{lines}\n"
            "Make every rank pass the same shape, dtype, op and root.")


_ROUND = agreement.checksum("torch DDP gradient reduction")


class Rounds:
    """The per-backward agreement of one group (see the module docstring)."""

    def __init__(self) -> None:
        self.forwards = 0  # DDP's training forwards on this group (torch_register counts them)
        self.count = 0  # backwards that reduced through this group
        self.off = False  # torch's Join: joined ranks reduce without a backward
        self._task = -1

    def agree(self, group: Any, context: Callable[[], Any]) -> None:
        """At a reduction from C++ that opens a backward: the round's agreement, finished before
        the bucket is sent, so that ranks in different operations meet in the slow path's
        exchange, not in a bucket (`context()`: the engine as the agreement sees it)."""
        task = torch._C._current_graph_task_id()
        if self.off or task == -1 or task == self._task:
            return
        self._task = task
        engine = context()
        if not engine.checks or not engine.backend.supports_device(torch.device("cpu")):
            return  # NCCL: the agreement would be a host synchronisation per step
        self.count += 1
        mine = f"torch DDP gradient reduction #{self.count} after {self.forwards} training forwards"
        try:
            agreement.agree(mine, group, codes=[_ROUND, self.count, self.forwards],
                            explain=_explain_rounds,
                            error=DivergedError, engine=engine)
        except CollectiveMismatchError:
            self.count = self.forwards = 0  # every rank raises here: count again, together
            raise


def _explain_rounds(ranks, said) -> str:
    lines = [f"  rank {r}: {text}" for r, text in zip(ranks, said, strict=True)]
    counted = [tuple(map(int, re.findall(r"\d+", text))) for text in said]
    fewest = min(f - n for n, f in counted)
    for rank, (n, f) in zip(ranks, counted, strict=True):
        if f - n > fewest:
            first = n + fewest  # its first training forward without a backward, counted from 1
            lines.append(f"rank {rank} skipped the backward (and optimizer step) of its training "
                         f"forward #{first} (step {first - 1} counting from 0): it ran {f} "
                         f"forwards for {n} backwards")
    return ("the ranks are reducing the gradients of different steps:\n"
            + "\n".join(lines) + "\n" + agreement.SKIP_ADVICE)


_counting: list[bool] = []


def count_ddp_forwards(group_type: type) -> None:
    """Make torch's DDP count its training forwards on groups of `group_type` (once per
    process): a forward that will reduce (grad enabled, sync on) adds one to its group's
    `rounds.forwards`. Wraps `DistributedDataParallel._pre_forward`, which every forward runs."""
    if _counting:
        return
    _counting.append(True)
    from torch.nn.parallel import DistributedDataParallel

    pre_forward = DistributedDataParallel._pre_forward

    @functools.wraps(pre_forward)
    def counted(self, *inputs: Any, **kwargs: Any) -> Any:
        group = getattr(self, "process_group", None)
        if isinstance(group, group_type) and not torch.compiler.is_compiling():
            if self._join_config.enable:
                group.rounds.off = True  # joined ranks shadow reductions without a backward
            elif torch.is_grad_enabled() and self.require_backward_grad_sync:
                group.rounds.forwards += 1
        return pre_forward(self, *inputs, **kwargs)

    DistributedDataParallel._pre_forward = counted
