"""The gradient reducer behind `DistributedOptimizer` and `DistributedDataParallel`.

How a step flows:

1. At construction the parameters are bucketed (`buckets.assign_buckets`, in reverse
   registration order: the order backward produces gradients), one flat buffer is allocated
   per bucket, and the ranks check ONCE that their layouts agree. Nothing is checked per step.
2. During backward, a post-accumulate-grad hook on each parameter moves its gradient into its
   slot of the bucket buffer, scaled by 1/size for op="mean" (one fused multiply, the pass
   DDP makes too), and makes `param.grad` a view of that slot (DDP's gradient_as_bucket_view):
   the reduced gradient is then where the optimizer reads it, with no copy back (DDP's default
   copies it back). With `zero_grad()`'s default set_to_none, autograd hands over a fresh
   gradient each step (as in one process) and the hook moves it in; passes that accumulate
   (`accumulate=k`, `no_sync()`, set_to_none=False) add straight into the bucket.
3. When a bucket's gradients are all in, it is handed to the communication hook
   (`comm_hook(bucket) -> Work`; by default one in-place all-reduce). Buckets are launched
   strictly in index order, because Gloo and MPI match collectives by their order: bucket i
   waits for buckets < i even when it is ready first.
4. At the end of the backward pass that completes a round (every backward with accumulate=1;
   the k-th of a window with accumulate=k; never one inside `no_sync()`), an autograd
   end-of-backward callback (DDP's mechanism) calls `finish_round()`: it launches, in order,
   the buckets backward did not complete (a parameter that got no gradient contributes zeros),
   then waits for every bucket in order. So **when `backward()` returns, every `.grad` holds
   the averaged gradient**, and the recipes of one-process training (clipping, GradScaler,
   reading gradients, `zero_grad()` anywhere) work unchanged. `step()` finishes a round only
   when one is still open (a short accumulation window, or passes made inside `no_sync()`).

Every bucket buffer ends with one "used" flag per parameter (1 when this rank produced a
gradient for it). A parameter whose gradient was None on every rank stays None, as it would in
one process, so optimizers skip it; the flags cost a few bytes per bucket and are only read
when this rank itself lacked a gradient in that bucket. Bucket 0 also carries a "contributed"
flag, which lets ranks that ran out of data answer the others (`td.join`, see join.py), or
the rank's weight when batches differ in size (samples.py): the sum is divided by its sum.

Timeline (`TANDEM_TIMELINE`): each bucket's reduction is a span on its `bucket <i>` row, from
launch until the reducer saw it complete, and each wait a span on the compute row. When the
timeline is off the reducer tests one module-level boolean per bucket.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.engines.backend import Work
from tandem.comm.groups import Group, group_rank, group_ranks, group_size
from tandem.diagnostics import timeline
from tandem.parallel.data_parallel import samples
from tandem.parallel.data_parallel.buckets import ParamInfo, assign_buckets, describe_layout
from tandem.parallel.data_parallel.comm_hooks import CommHook, GradBucket, allreduce_hook
from tandem.parallel.data_parallel.join_rounds import JoinRounds
from tandem.parallel.data_parallel.reducer_front import GradientLayoutError, agree_layout  # noqa: F401
from tandem.parallel.layout import splits
from tandem.parallel.operation_check import OperationCheck

_ROUND = "gradient reduction"  # the operation each round agrees on (OperationCheck)
_live: weakref.WeakSet[Reducer] = weakref.WeakSet()  # for td.join() without arguments


def live_reducers() -> list[Reducer]:
    """The reducers of this process that still have their hooks, oldest first."""
    return sorted((r for r in _live if not r._closed), key=lambda r: r._serial)


class Reducer(JoinRounds):
    """Buckets, hooks and the launch/wait protocol for one set of parameters."""

    _serials = 0

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        op: str = "mean",
        comm_hook: CommHook = allreduce_hook,
        cap_bytes: int,
        first_cap_bytes: int,
        accumulate: int = 1,
        group: Group | None = None,
        on_round_end: Callable[[float], None] | None = None,
        owner: str = "DistributedOptimizer",
        options: str = "",
    ) -> None:
        if not named_params:
            raise ValueError(f"{owner}: no parameter requires a gradient; nothing to reduce")
        mixed = [name for name, p in named_params if splits.mixes_slices(p, group)]
        if mixed:
            raise ValueError(
                f"{owner} over ranks {list(group_ranks(group))} would average different "
                f"tensor-parallel slices (or branches) of {mixed[0]!r}, training another model: "
                f"reduce over the ranks that hold the same slices, group=mesh.dp_group")
        state = runtime.state()
        self._backend = state.backend
        self._timeout = state.timeout
        self._group = group
        self._size = group_size(group)
        self._owner = owner
        self._op = op
        self._hook = comm_hook
        self._accumulate = accumulate
        self._on_round_end = on_round_end
        self._mean_scale = 1.0 / self._size if op == "mean" else 1.0
        self._scale = self._mean_scale
        # Weights of uneven batches, each micro-batch of an accumulation window by its own
        # (samples.py); op="sum" sums as it says, so it takes no report.
        self._samples = samples.WindowSamples(self._size, self._accumulated_grads,
                                              lambda: op == "mean" and not self._closed)

        # Expected gradient-ready order: reverse registration order.
        ordered = list(reversed(named_params))
        self._names = [name for name, _ in ordered]
        self._params = [p for _, p in ordered]
        infos = [ParamInfo.of(name, p) for name, p in ordered]
        # Small first AND last buckets: communication starts early and little is left to do
        # once backward ends (see buckets.py).
        layout = assign_buckets(infos, cap_bytes, first_cap_bytes, last_cap_bytes=first_cap_bytes)
        lines = describe_layout(infos, layout) + [f"options {options}"]
        agree_layout(owner, lines, group, self._timeout)  # once: nothing is checked per step
        # Every round opens with one agreement that all ranks are in it (operation_check.py):
        # the wrapper counts its steps and forwards; the weights are checksummed at the first.
        self.step_check = OperationCheck.make("", owner, lines, group, weights=self._params,
                                              carries_stop=True)

        self.buckets: list[GradBucket] = []
        self._members: list[tuple[int, ...]] = []
        self._bucket_of = [0] * len(self._params)
        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for spec in layout:
            # The tail: one used flag per parameter, and on bucket 0 a "this rank contributed"
            # flag (see join.py). Summed with the gradients, they cost no extra message.
            tail = len(spec.params) + (1 if spec.index == 0 else 0)
            buffer = torch.zeros(spec.numel + tail, dtype=spec.dtype, device=spec.device)
            views = []
            for i, offset, n in zip(spec.params, spec.offsets, spec.numels, strict=True):
                view = buffer[offset : offset + n].view(self._params[i].shape)
                self._views[i] = view
                self._bucket_of[i] = spec.index
                views.append(view)
            names = [self._names[i] for i in spec.params]
            self.buckets.append(GradBucket(spec.index, buffer, spec.numel, views, names, group,
                                           self._size, self._backend))
            self._members.append(spec.params)
        self.bytes_per_round = sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)
        # After bucket 0 is reduced: how many ranks contributed this round.
        self._contributors = self.buckets[0].tail[-1]

        self._sync_enabled = True
        self._join_mode = False
        self._launched_ns = [0] * len(self.buckets)
        timeline.configure()
        self.rounds = 0
        self._reset_round()
        self._closed = False
        self._handles = []
        for i, p in enumerate(self._params):
            other = splits.reducer_of(p)
            if other is not None and not other._closed:
                raise ValueError(
                    f"{owner}: parameter {self._names[i]!r} is already reduced by another "
                    f"{other._owner}; wrap each parameter in one of them only"
                )
        me = weakref.ref(self)
        for i, p in enumerate(self._params):
            splits.set_reducer(p, me)
            self._handles.append(p.register_post_accumulate_grad_hook(_make_hook(me, i)))
        weakref.finalize(self, _remove_hooks, list(self._handles))
        Reducer._serials += 1
        self._serial = Reducer._serials
        _live.add(self)

    # -- per-step state ----------------------------------------------------------------------
    def _reset_round(self) -> None:
        if not hasattr(self, "_counts"):
            self._counts = [0] * len(self._params)
            self._sizes = [len(m) for m in self._members]
            self._pending = list(self._sizes)
            self._ready = [False] * len(self.buckets)
            self._works: list[Work | None] = [None] * len(self.buckets)
            self._unused: list[list[int]] = [[] for _ in self.buckets]
        # In place: the per-step bookkeeping allocates nothing.
        self._counts[:] = itertools.repeat(0, len(self._counts))
        self._pending[:] = self._sizes
        self._ready[:] = itertools.repeat(False, len(self._ready))
        self._works[:] = itertools.repeat(None, len(self._works))
        for unused in self._unused:
            unused.clear()
        self._next = 0
        self._agreement: agreement.Posted | None = None  # this round's, once its first gradient is in
        self.max_passes = 0
        self._local_passes = False
        self._callback_queued = False  # also after a backward that raised before its end
        self._samples.reset()
        self._grad_scale = self._scale  # what _move_in multiplies by: see _take_samples

    def _take_samples(self) -> None:
        """The window's weighting, once per pass (a report comes from the loader or
        `td.samples` between passes, and `WindowSamples` has already rescaled what the
        earlier passes left in `.grad`): the factor on an uneven window, else 1/size."""
        self._grad_scale = self._samples.factor if self._samples.weighted else self._scale

    def _accumulated_grads(self):
        """What autograd has added up so far, outside the buckets' reduction."""
        return (p.grad for p in self._params if p.grad is not None)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters this reducer averages, with their names (in reduction order)."""
        return list(zip(self._names, self._params, strict=True))

    def has_pending(self) -> bool:
        """Whether reductions were launched and not yet waited for."""
        return self._next > 0

    def round_open(self) -> bool:
        """Whether gradients were produced since the last finished round (a short accumulation
        window, or backward passes inside `no_sync()`), so a step must still reduce them."""
        return self.max_passes > 0 or self._next > 0 or self._local_passes

    def reset_window(self) -> None:
        """Forget gradients counted since the last round (zero_grad wiped them)."""
        # Only when something was counted: after a step the round is already fresh.
        if self._next == 0 and (self.max_passes or self._local_passes or self._callback_queued):
            self._reset_round()

    def set_sync(self, enabled: bool) -> None:
        self._sync_enabled = enabled

    @property
    def sync_enabled(self) -> bool:
        return self._sync_enabled

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def accumulate(self) -> int:
        """Backward passes per reduction (1: every backward)."""
        return self._accumulate

    # -- backward ----------------------------------------------------------------------------
    def _on_grad(self, i: int) -> None:
        if self._params[i].grad.is_sparse:  # before anything is posted: every rank raises here
            raise ValueError(
                f"{self._owner}: rank {runtime.rank()}: parameter {self._names[i]!r} got a sparse "
                f"gradient (nn.Embedding(sparse=True), what SparseAdam steps); the gradients are "
                f"averaged in dense buckets. Use tandem.horovod's "
                f"hvd.DistributedOptimizer(torch.optim.SparseAdam(...), named_parameters=...) "
                f"(sparse gradients averaged densely, handed back sparse), or sparse=False with "
                f"a dense optimizer such as AdamW")
        if not self._sync_enabled:
            self._take_samples()
            if self._next > 0:  # autograd just accumulated into a buffer being reduced
                raise RuntimeError(
                    f"{self._owner}: backward() inside no_sync() while reductions launched by an "
                    f"earlier backward() that did not finish are still in flight; call synchronize() "
                    f"on every rank first (or end the job)"
                )
            self._local_passes = True
            return  # no_sync(): autograd accumulates locally in param.grad
        if not self._callback_queued:
            # Once per backward pass: its end finishes the round (see the module docstring).
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._take_samples()
        b = self._bucket_of[i]
        count = self._counts[i] + 1
        if b < self._next or count > self._accumulate:
            raise RuntimeError(
                f"{self._owner}: parameter {self._names[i]!r} received a gradient after its bucket "
                f"was reduced ({count} backward passes since the last step, accumulate="
                f"{self._accumulate}). Call step() after every {self._accumulate} backward "
                f"pass(es), or accumulate the extra passes inside no_sync()."
            )
        self._counts[i] = count
        if count > self.max_passes:
            if self.max_passes == 0 and timeline.ENABLED:
                timeline.backward_started()  # the round's first gradient: forward is over
            self.max_passes = count
        if count < self._accumulate:
            return
        if self._agreement is None and self.step_check is not None and not self._join_mode:
            # Travels while backward runs; ranks must also weight this round alike.
            self._agreement = self.step_check.send(_ROUND, self._samples.code)
        self._move_in(i)
        left = self._pending[b] - 1
        self._pending[b] = left
        if left == 0:
            self._ready[b] = True
            while self._next < len(self.buckets) and self._ready[self._next]:
                self._launch(self._next)

    def _move_in(self, i: int) -> None:
        """Make param i's gradient (times the scale) live in its bucket slot."""
        param, view, scale = self._params[i], self._views[i], self._grad_scale
        grad = param.grad
        if grad is view:
            if scale != 1.0:
                view.mul_(scale)
            return
        if scale != 1.0:
            torch.mul(grad, scale, out=view)
        else:
            view.copy_(grad)
        param.grad = view

    def _fill_missing(self, b: int) -> None:
        """Before a forced launch: parameters that did not finish their passes join as they are."""
        for position, i in enumerate(self._members[b]):
            if self._counts[i] >= self._accumulate:
                continue
            if self._params[i].grad is None:
                self._views[i].zero_()  # this rank contributes nothing for it
                self._unused[b].append(position)
            else:
                self._move_in(i)

    def _launch(self, b: int) -> None:
        if b == 0 and self.step_check is not None and not self._join_mode:
            self.step_check.agree(_ROUND, posted=self._agreement)
        bucket = self.buckets[b]
        bucket.tail.fill_(1.0)
        for position in self._unused[b]:
            bucket.tail[position] = 0.0
        if b == 0 and self._samples.weighted:
            self._contributors.fill_(self._samples.divisor())  # summed: the divisor of the mean
        if timeline.ENABLED:
            self._launched_ns[b] = timeline.now()
        self._works[b] = self._hook(bucket)
        self._next = b + 1

    def _backward_done(self) -> None:
        self._callback_queued = False
        # accumulate=k: only the pass that completes the window ends the round.
        if self.max_passes >= self._accumulate:
            self.finish_round()

    # -- completion --------------------------------------------------------------------------
    def finish_round(self) -> float:
        """Launch what backward did not, wait for every bucket in order; return seconds waited."""
        if self._next < len(self.buckets):  # buckets left to fill: td.join may have changed it
            self._take_samples()
        for b in range(self._next, len(self.buckets)):
            if not self._ready[b]:
                self._fill_missing(b)
            self._launch(b)
        waited = 0.0
        # The mean over the ranks that contributed (td.join), or over their samples (samples.py).
        divide = (self._join_mode and self._op == "mean") or self._samples.weighted
        for b, bucket in enumerate(self.buckets):
            waited += self._wait(self._works[b], b)
            if self._unused[b]:
                self._restore_unused(b)
            if divide:
                bucket.grads.div_(self._contributors)  # a tensor: no host read
        self.rounds += 1
        self._reset_round()
        if self._on_round_end is not None:
            self._on_round_end(waited)
        return waited

    def _wait(self, work: Work, b: int) -> float:
        start = time.perf_counter_ns()
        try:
            work.wait(self._timeout)
        except TimeoutError as error:
            names = self.buckets[b].names
            what = (f"gradient bucket {b} of {len(self.buckets)} ({', '.join(names[:4])}"
                    f"{', ...' if len(names) > 4 else ''})")
            raise TimeoutError(
                f"{self._owner}: rank {runtime.rank()} waited {self._timeout:.0f} s for {what} to be "
                f"reduced over the ranks {list(group_ranks(self._group))}. Another rank failed or "
                f"stopped stepping; if ranks have different numbers of batches, run the loop "
                f"inside `with td.join(opt):`."
            ) from error
        end = time.perf_counter_ns()  # the timeline's clock too
        if timeline.ENABLED:
            timeline.complete("wait", start, end, timeline.COMPUTE, {"bucket": b})
            timeline.complete("allreduce", self._launched_ns[b] or start, end, timeline.BUCKET0 + b,
                              {"bytes": self.buckets[b].buffer.nbytes})
        return (end - start) * 1e-9

    def _restore_unused(self, b: int) -> None:
        """Parameters with no gradient here: None again if no rank had one, else the average."""
        flags = self.buckets[b].tail.tolist()
        for position in self._unused[b]:
            i = self._members[b][position]
            if flags[position] != 0:
                self._params[i].grad = self._views[i]

    @property
    def group(self) -> Group | None:
        return self._group

    def group_rank(self) -> int:
        return group_rank(self._group)

    def close(self) -> None:
        """Remove the hooks; the parameters are plain again."""
        _remove_hooks(self._handles)
        self._handles.clear()
        self._closed = True


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _make_hook(reducer_ref: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: dropping the optimizer must not keep its reducer (and its buffers)
    # alive through the model's hooks; a dead reducer's hook does nothing.
    def hook(_param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None and not reducer._closed:
            reducer._on_grad(i)

    return hook
