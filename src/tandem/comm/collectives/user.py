"""The user-facing collectives: one name each, with `inplace=` and `async_op=`.

Every function here takes a torch tensor (CPU or CUDA) or a NumPy array (returned as NumPy),
checks that all ranks agree on the arguments (see `checks`), and runs on whatever backend
`td.init` chose. Roots, sources and destinations are global ranks; torch's keyword names
(`src=`, `dst=`, `op=dist.ReduceOp.SUM`) are accepted beside tandem's (`root=`, `op="sum"`).

**In place and returned.** `allreduce`, `broadcast` and `reduce` write the result into the
tensor given *and* return it, so both idioms users bring give the right answer:
`td.allreduce(p.grad)` (torch.distributed's, where the call's effect is on the tensor) and
`t = td.allreduce(t)` (Horovod's, where the result is returned). A copy-returning default
made the first idiom a silent no-op: the replicas of a port of `dist.all_reduce(p.grad)` drift
apart while every line runs. `inplace=False` leaves the tensor alone and returns a new one
(what `tandem.horovod` passes: Horovod's `allreduce` never writes its input).
"""

from __future__ import annotations

import ctypes
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tandem.comm import context
from tandem.comm.agreement import checks, exchange
from tandem.comm.engines.backend import Group, Work, on_wire
from tandem.comm.members import group_ranks, group_size

OPS = ("sum", "mean", "min", "max", "product")
Array = torch.Tensor | np.ndarray


class Handle:
    """An asynchronous collective: `wait()` returns its result, `done()` polls.

    Made by the collectives given `async_op=True`, not by users.

    Args:
        work: the engine's pending operation.
        finish: what `wait()` runs once `work` has completed; its value is the result.
    """

    def __init__(self, work: Work, finish: Callable[[], Any]) -> None:
        self._work = work
        self._finish = finish
        self._finished = False
        self._result: Any = None

    def done(self) -> bool:
        return self._finished or self._work.is_completed()

    def wait(self) -> Any:
        if not self._finished:
            self._work.wait(context.current().timeout)
            self._result = self._finish()
            self._finished = True
        return self._result


def complete(work: Work, finish: Callable[[], Any], async_op: bool):
    if async_op:
        return Handle(work, finish)
    work.wait(context.current().timeout)
    return finish()


_TORCH_OPS = {"SUM": "sum", "AVG": "mean", "MIN": "min", "MAX": "max", "PRODUCT": "product"}


def _check_op(op: Any) -> str:
    """`op` as tandem's name: one of OPS, or torch.distributed's `ReduceOp` for it."""
    if isinstance(op, str):
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}: choose one of {', '.join(OPS)}")
        return op
    for torch_name, name in _TORCH_OPS.items():
        if op == getattr(torch.distributed.ReduceOp, torch_name, None):
            return name
    raise ValueError(f"unknown op {op!r}: choose one of {', '.join(OPS)} (or torch.distributed's "
                     f"ReduceOp.{', ReduceOp.'.join(_TORCH_OPS)})")


def one_rank(name: str, value: int, torch_name: str, torch_value: int | None) -> int:
    """`root=` or torch's spelling (`src=`, `dst=`), not two different ranks."""
    if torch_value is None:
        return value
    if value not in (0, torch_value):
        raise ValueError(f"{name}={value} and {torch_name}={torch_value} name different ranks: "
                         f"give one of them")
    return torch_value


def check_member(group: Group | None) -> None:
    if group is not None and group.rank < 0:
        raise ValueError(
            f"rank {context.current().world.rank} is not a member of {group!r}; only members may call it"
        )


def check_rank(name: str, value: int, group: Group | None) -> None:
    if value not in group_ranks(group):
        raise ValueError(f"{name}={value} is not a rank of the group {list(group_ranks(group))}")


def to_torch(data: Array, name: str = "tensor") -> tuple[torch.Tensor, bool]:
    if isinstance(data, torch.Tensor):
        return data, False
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data), True
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, not {type(data).__name__}")


def returned(tensor: torch.Tensor, as_numpy: bool) -> Array:
    return tensor.numpy() if as_numpy else tensor


_GLOO_WIDER = {torch.int16: torch.int32}


class Staging:
    """A contiguous buffer on a device the backend accepts, copied back when done."""

    __slots__ = ("original", "buffer")

    def __init__(self, tensor: torch.Tensor, engine: context.Context | None = None) -> None:
        self.original = tensor
        engine = engine or context.current()
        if tensor.dtype in _GLOO_WIDER and engine.backend.name == "gloo":
            # Gloo has no int16: int32 carries it; sums wrap back to int16 as they would natively.
            self.buffer = tensor.to(_GLOO_WIDER[tensor.dtype]).contiguous()
        else:
            self.buffer = on_wire(tensor, engine.backend).contiguous()

    def copy_back(self) -> torch.Tensor:
        if self.buffer is not self.original:
            self.original.copy_(self.buffer)
        return self.original


_NATIVE_OF = {"sum": "sum", "mean": "sum", "min": "min", "max": "max", "product": "product"}
_CPU = torch.device("cpu")
# The last backend asked, whether it takes CPU tensors as they are, the dtypes it does not
# (Gloo's int16), and whether it prepares repeated all-reduces (`Plan`): asked once per
# backend, not per call.
_cpu: list = [None, False, frozenset(), False]


def _learn_cpu(backend) -> None:
    _cpu[:] = [backend, backend.supports_device(_CPU),
               frozenset(_GLOO_WIDER) if backend.name == "gloo" else frozenset(),
               getattr(backend, "allreduce_plan", None) is not None]


class Plan:
    """A repeated blocking `allreduce` or `broadcast` of one tensor's memory on the world: the
    engine's prepared call (`run`) and, for "mean", the division on a NumPy view of that memory
    (`divide`; torch's `div_` costs 2 us of dispatch, NumPy's 0.6, next to a 3 us message).

    Kept by address, count, dtype and op (or root), as the engine keeps its buffer specs: a
    later tensor at that address, with that count and dtype, is the same memory. Neither holds
    the tensor.
    """

    __slots__ = ("state", "run", "divide", "seen")

    def __init__(self, state: context.Context, run: Callable, divide: Callable | None) -> None:
        self.state, self.run, self.divide = state, run, divide
        self.seen: list = [None, None, None]  # the check's last line, shape and message


_plans: dict[tuple, Plan] = {}
_MOST_PLANS = 256  # tensors kept (a job reduces a few dozen small ones); past it, start again


def _plan(state: context.Context, tensor: torch.Tensor, op: str) -> None:
    """Keep a `Plan` for `tensor` (the engine prepares calls: MPI), unless it has no NumPy dtype."""
    divide = None
    if op == "mean":
        try:
            kind = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        except TypeError:  # no NumPy dtype (bfloat16): the engine would not plan it either
            return
        memory = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
        view, n = np.frombuffer(memory, dtype=kind), state.world.size
        # Integer mean rounds down, as `divide` does.
        divide = functools.partial(np.true_divide if tensor.is_floating_point()
                                   or tensor.is_complex() else np.floor_divide, view, n, out=view)
    run = state.backend.allreduce_plan(tensor, _NATIVE_OF[op],
                                       getattr(state.backend, "watchdog", None))
    if run is not None:
        _keep(tensor, op, Plan(state, run, divide))


def _keep(tensor: torch.Tensor, what: str | int, plan: Plan) -> None:
    """Keep `plan` for `tensor`'s memory and `what` (an all-reduce's op, a broadcast's root)."""
    if len(_plans) >= _MOST_PLANS:
        _plans.clear()
    _plans[(tensor.data_ptr(), tensor.numel(), tensor.dtype, what)] = plan


def divide(tensor: torch.Tensor, n: int) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(n)
    # Integer mean rounds down, as NumPy's `sum // n` does.
    return torch.div(tensor, n, rounding_mode="floor", out=tensor)


def allreduce(
    tensor: Array,
    op: str = "mean",
    *,
    inplace: bool = True,
    async_op: bool = False,
    group: Group | None = None,
):
    """Reduce `tensor` across the ranks of `group`; every rank gets the result.

    Args:
        tensor: a torch tensor (CPU or CUDA) or a NumPy array, of one shape and dtype on
            every rank.
        op: "mean" (the default), "sum", "min", "max" or "product", or torch.distributed's
            `ReduceOp`. An integer mean rounds down.
        inplace: write the result into `tensor` (the default) as well as return it; False
            leaves `tensor` alone and returns a new tensor.
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        The reduced tensor (`tensor` itself unless inplace=False), NumPy for NumPy input, or a
        `Handle` with async_op=True.

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes or ops (each rank's named).
        ValueError: an unknown op, or a rank outside `group`.
    """
    # The common case written out (a contiguous tensor the engine takes as it is, a known op's
    # name, the world, blocking): a few microseconds of Python per call is what a small message
    # costs on the wire (issue 46, item 2), so it goes to the engine with nothing between but
    # the check, when checks are on. A tensor seen before runs its `Plan`.
    if tensor.__class__ is torch.Tensor and group is None and inplace and not async_op \
            and op.__class__ is str:
        try:
            plan = _plans.get((tensor.data_ptr(), tensor.numel(), tensor.dtype, op))
        except RuntimeError:  # no storage (a sparse tensor): the general path says why
            plan = None
        if plan is not None and plan.state is context.active and tensor.is_contiguous():
            state = plan.state
            if state.checks or state.debug:
                checks.agree_again("allreduce", tensor, state, plan.seen, op=op)
            work = plan.run(tensor)
            if work is not None:
                work.wait(state.timeout)
            if plan.divide is not None:
                plan.divide()
            return tensor
    state = context.active
    if tensor.__class__ is torch.Tensor and group is None and inplace and not async_op \
            and state is not None and tensor.is_cpu and op.__class__ is str and op in _NATIVE_OF:
        backend = state.backend
        if backend is not _cpu[0]:
            _learn_cpu(backend)
        if _cpu[1] and tensor.dtype not in _cpu[2] and tensor.is_contiguous():
            if state.checks or state.debug:
                checks.agree("allreduce", tensor, None, op=op, engine=state)
            work = backend.allreduce_now(tensor, _NATIVE_OF[op], None)
            if work is not None:
                work.wait(state.timeout)
            if op == "mean":
                if tensor.is_floating_point():
                    tensor.div_(state.world.size)
                else:
                    divide(tensor, state.world.size)
            if _cpu[3]:
                _plan(state, tensor, op)
            return tensor
    if op.__class__ is not str or op not in OPS:
        op = _check_op(op)
    if group is not None:
        check_member(group)
    if tensor.__class__ is torch.Tensor:
        data, as_numpy = tensor, False
    else:
        data, as_numpy = to_torch(tensor)
    state = context.current()
    if state.checks or state.debug:
        checks.agree("allreduce", data, group, op=op, engine=state)
    backend = state.backend
    staging = Staging(data if inplace else data.clone(), state)
    native = "sum" if op == "mean" else op
    if async_op:
        work = backend.allreduce(staging.buffer, native, group)
        return Handle(work, lambda: _reduced(staging, op, group, as_numpy))
    # Waited for at once: the engine may finish it on the spot (see Backend.allreduce_now).
    work = backend.allreduce_now(staging.buffer, native, group)
    if work is not None:
        work.wait(state.timeout)
    return _reduced(staging, op, group, as_numpy)


def _reduced(staging: Staging, op: str, group: Group | None, as_numpy: bool) -> Array:
    result = staging.copy_back()
    if op == "mean":
        divide(result, group_size(group))
    return returned(result, as_numpy)


def broadcast(
    tensor: Array,
    root: int = 0,
    *,
    src: int | None = None,
    inplace: bool = True,
    async_op: bool = False,
    group: Group | None = None,
):
    """Every rank gets `root`'s tensor: written into `tensor` (unless inplace=False) and
    returned.

    Args:
        tensor: the data on `root`; a tensor of the same shape and dtype elsewhere.
        root: the global rank whose tensor is sent (torch's name `src=` is accepted).
        inplace, async_op, group: as for `allreduce`.

    Returns:
        `root`'s tensor (`tensor` itself unless inplace=False), or a `Handle` with async_op.

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes or roots.
        ValueError: `root` is not a rank of `group`.
    """
    if tensor.__class__ is torch.Tensor and group is None and inplace and not async_op \
            and src is None and root.__class__ is int:
        try:  # a tensor seen before runs its `Plan`, as in allreduce
            plan = _plans.get((tensor.data_ptr(), tensor.numel(), tensor.dtype, root))
        except RuntimeError:
            plan = None
        if plan is not None and plan.state is context.active and tensor.is_contiguous():
            state = plan.state
            if state.checks or state.debug:
                checks.agree_again("broadcast", tensor, state, plan.seen, root=root)
            work = plan.run(tensor)
            if work is not None:
                work.wait(state.timeout)
            return tensor
    state = context.active
    if tensor.__class__ is torch.Tensor and group is None and inplace and not async_op \
            and src is None and state is not None and tensor.is_cpu \
            and root.__class__ is int and 0 <= root < state.world.size:
        backend = state.backend  # the common case written out, as in allreduce
        if backend is not _cpu[0]:
            _learn_cpu(backend)
        if _cpu[1] and tensor.dtype not in _cpu[2] and tensor.is_contiguous():
            if state.checks or state.debug:
                checks.agree("broadcast", tensor, None, root=root, engine=state)
            work = backend.broadcast_now(tensor, root, None)
            if work is not None:
                work.wait(state.timeout)
            if _cpu[3]:
                run = backend.broadcast_plan(tensor, root, getattr(backend, "watchdog", None))
                if run is not None:
                    _keep(tensor, root, Plan(state, run, None))
            return tensor
    if src is not None:
        root = one_rank("root", root, "src", src)
    if group is not None:
        check_member(group)
    check_rank("root", root, group)
    if tensor.__class__ is torch.Tensor:
        data, as_numpy = tensor, False
    else:
        data, as_numpy = to_torch(tensor)
    state = context.current()
    if state.checks or state.debug:
        checks.agree("broadcast", data, group, root=root, engine=state)
    staging = Staging(data if inplace else data.clone(), state)
    work = state.backend.broadcast(staging.buffer, root, group)
    return complete(work, lambda: returned(staging.copy_back(), as_numpy), async_op)


def reduce(
    tensor: Array,
    root: int = 0,
    op: str = "sum",
    *,
    dst: int | None = None,
    inplace: bool = True,
    async_op: bool = False,
    group: Group | None = None,
):
    """Reduce onto `root`: the root's `tensor` holds the result (unless inplace=False) and it
    is returned there; the other ranks get their input back, unchanged.

    Args:
        tensor: the same shape and dtype on every rank.
        root: the global rank that receives the result (torch's name `dst=` is accepted).
        op: as for `allreduce`; the default is "sum", as torch's `dist.reduce`.
        inplace, async_op, group: as for `allreduce`.

    Returns:
        On `root` the reduced tensor, elsewhere the input; or a `Handle` with async_op=True.

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes, ops or roots.
        ValueError: an unknown op, or `root` outside `group`.
    """
    root = one_rank("root", root, "dst", dst)
    op = _check_op(op)
    check_member(group)
    check_rank("root", root, group)
    data, as_numpy = to_torch(tensor)
    checks.agree("reduce", data, group, op=op, root=root)
    staging = Staging(data.clone())
    work = context.current().backend.reduce(staging.buffer, root, "sum" if op == "mean" else op, group)
    is_root = context.current().world.rank == root

    def finish():
        if not is_root:
            return returned(data if inplace else data.clone(), as_numpy)  # untouched
        result = staging.copy_back()
        if op == "mean":
            divide(result, group_size(group))
        if inplace:
            data.copy_(result)
            result = data
        return returned(result, as_numpy)

    return complete(work, finish, async_op)


def allgather(tensor: Array, *, async_op: bool = False, group: Group | None = None):
    """Concatenate every rank's tensor along dim 0; first dims may differ across ranks.

    Args:
        tensor: a torch tensor or NumPy array; the dims after the first, and the dtype, equal on
            every rank (a 0-d tensor counts as one row).
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        The rows of every rank of `group` in rank order (a new tensor; NumPy for NumPy input), or
        a `Handle` with async_op=True.

    Raises:
        CollectiveMismatchError: ranks passed other trailing dims or dtypes (each rank's named).
        ValueError: this rank is not a member of `group`.
        TypeError: `tensor` is neither a torch tensor nor a NumPy array.
    """
    state = context.active
    if tensor.__class__ is torch.Tensor and group is None and not async_op \
            and state is not None and tensor.is_cpu and tensor.dim():
        backend = state.backend  # the common case written out, as in allreduce
        if backend is not _cpu[0]:
            _learn_cpu(backend)
        if _cpu[1] and tensor.dtype not in _cpu[2] and tensor.is_contiguous():
            n = state.world.size
            same = (checks.agree("allgather", tensor, None, ignore_dim0=True, engine=state)
                    if state.checks or state.debug else None)
            if same or n == 1:  # the check compared the first dims: no lengths to exchange
                output = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
                backend.allgather_into(output, tensor, None).wait(state.timeout)
                return output
            return _gathered(tensor, exchange.lengths(tensor.shape[0], None, state), False,
                             False, None)
    check_member(group)
    data, as_numpy = to_torch(tensor)
    if data.dim() == 0:
        data = data.reshape(1)
    n = group_size(group)
    if checks.agree("allgather", data, group, ignore_dim0=True) or n == 1:
        lengths = [data.shape[0]] * n  # the check compared the first dims: one message saved
    else:
        lengths = exchange.lengths(data.shape[0], group, context.current())
    return _gathered(data, lengths, as_numpy, async_op, group)


def _gathered(data: torch.Tensor, lengths: list[int], as_numpy: bool, async_op: bool,
              group: Group | None):
    """`allgather`'s data, once every rank's first dim is known (`lengths`)."""
    n = len(lengths)
    longest = max(lengths)
    rest = tuple(data.shape[1:])
    padded = data
    if data.shape[0] < longest:
        padded = torch.zeros((longest, *rest), dtype=data.dtype, device=data.device)
        padded[: data.shape[0]] = data
    source = Staging(padded.contiguous())
    output = Staging(torch.empty((n * longest, *rest), dtype=data.dtype, device=data.device))
    work = context.current().backend.allgather_into(output.buffer, source.buffer, group)

    def finish():
        gathered = output.copy_back()
        if all(length == longest for length in lengths):
            return returned(gathered, as_numpy)
        pieces = [gathered[i * longest : i * longest + lengths[i]] for i in range(n)]
        return returned(torch.cat(pieces), as_numpy)

    return complete(work, finish, async_op)


def reducescatter(
    tensor: Array, op: str = "sum", *, async_op: bool = False, group: Group | None = None
):
    """Reduce, then give rank i the i-th of `size` equal chunks along dim 0.

    Args:
        tensor: a torch tensor or NumPy array of one shape and dtype on every rank, its dim 0
            divisible by the group's size.
        op: "sum" (the default), "mean", "min", "max" or "product", or torch.distributed's
            `ReduceOp`.
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        This rank's chunk of the reduced tensor (a new tensor of dim 0 `rows / size`; NumPy for
        NumPy input), or a `Handle` with async_op=True.

    Raises:
        CollectiveMismatchError: ranks passed other shapes, dtypes or ops (each rank's named).
        ValueError: dim 0 not divisible by the group size (pad it, or use allreduce), an
            unknown op, or this rank not a member of `group`.
    """
    op = _check_op(op)
    check_member(group)
    data, as_numpy = to_torch(tensor)
    n = group_size(group)
    if data.dim() == 0 or data.shape[0] % n:
        raise ValueError(
            f"reducescatter needs dim 0 divisible by the group size {n}; got shape "
            f"{tuple(data.shape)}. Pad the tensor or use allreduce."
        )
    checks.agree("reducescatter", data, group, op=op)
    source = Staging(data)
    output = Staging(
        torch.empty((data.shape[0] // n, *data.shape[1:]), dtype=data.dtype, device=data.device)
    )
    native = "sum" if op == "mean" else op
    work = context.current().backend.reducescatter_into(output.buffer, source.buffer, native, group)

    def finish():
        result = output.copy_back()
        if op == "mean":
            divide(result, n)
        return returned(result, as_numpy)

    return complete(work, finish, async_op)


def alltoall(
    tensor: Array,
    splits: Sequence[int] | None = None,
    *,
    async_op: bool = False,
    group: Group | None = None,
):
    """Send `splits[j]` rows to rank j (equal parts when None); returns what arrived, in order.

    Args:
        tensor: a torch tensor or NumPy array; the dims after the first, and the dtype, equal on
            every rank.
        splits: how many of this rank's rows go to each rank of `group`, in order (they sum to
            dim 0); None splits dim 0 into equal parts.
        async_op: return a `Handle` at once; its `wait()` gives the result.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        The rows received from each rank, concatenated in rank order (NumPy for NumPy input), or
        a `Handle` with async_op=True.

    Raises:
        CollectiveMismatchError: ranks passed other trailing dims or dtypes.
        ValueError: `splits` is not `size` non-negative counts summing to dim 0, dim 0 is not
            divisible by the group size when `splits` is None, or this rank is not a member.
    """
    check_member(group)
    data, as_numpy = to_torch(tensor)
    n = group_size(group)
    rows = data.shape[0] if data.dim() else 0
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall without splits needs dim 0 divisible by the group size {n}; got "
                f"shape {tuple(data.shape)}. Pass splits=[rows for each rank]."
            )
        splits = [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(
            f"alltoall splits {splits} must be {n} non-negative counts summing to dim 0 ({rows})"
        )
    checks.agree("alltoall", data, group, ignore_dim0=True)
    # Tell every rank how many rows to expect from each peer: one small all-to-all.
    incoming = Staging(torch.empty(n, dtype=torch.int64))
    outgoing = Staging(torch.tensor(splits, dtype=torch.int64))
    backend = context.current().backend
    backend.alltoall_into(incoming.buffer, outgoing.buffer, [1] * n, [1] * n, group).wait(
        context.current().timeout
    )
    received = incoming.copy_back().tolist()
    source = Staging(data)
    output = Staging(
        torch.empty((sum(received), *data.shape[1:]), dtype=data.dtype, device=data.device)
    )
    work = backend.alltoall_into(output.buffer, source.buffer, received, splits, group)
    return complete(work, lambda: returned(output.copy_back(), as_numpy), async_op)


def send(tensor: Array, dst: int, tag: int = 0, *, async_op: bool = False,
         group: Group | None = None):
    """Send to global rank `dst`; the matching `recv` must pass a tensor of the same shape.

    Args:
        tensor: a torch tensor or NumPy array.
        dst: the global rank that receives it (not this rank).
        tag: tells apart several messages between the same two ranks; the `recv` passes the same.
        async_op: return a `Handle` at once; its `wait()` returns None once sent.
        group: the group the message travels in (None: the world); `dst` is still global.

    Returns:
        None once the message is sent, or a `Handle` with async_op=True.

    Raises:
        ValueError: `dst` is not a rank of the world, or is this rank.
        WatchdogTimeout: the receiver did not take the message within the timeout.
    """
    check_rank("dst", dst, None)
    if dst == context.current().world.rank:
        raise ValueError(f"rank {dst} cannot send to itself")
    data, _ = to_torch(tensor)
    staging = Staging(data)
    work = context.current().backend.send(staging.buffer, dst, tag, group)
    return complete(work, lambda: None, async_op)


def recv(tensor: Array, src: int, tag: int = 0, *, async_op: bool = False,
         group: Group | None = None):
    """Receive from global rank `src` into `tensor` (in place) and return it.

    Args:
        tensor: the buffer to fill: the shape and dtype the sender's `send` passes.
        src: the global rank that sends (not this rank).
        tag: the tag the matching `send` passes.
        async_op: return a `Handle` at once; its `wait()` gives the filled tensor.
        group: the group the message travels in (None: the world); `src` is still global.

    Returns:
        `tensor`, filled with the message, or a `Handle` with async_op=True.

    Raises:
        ValueError: `src` is not a rank of the world, or is this rank.
        WatchdogTimeout: no message arrived within the timeout.
    """
    check_rank("src", src, None)
    if src == context.current().world.rank:
        raise ValueError(f"rank {src} cannot receive from itself")
    data, as_numpy = to_torch(tensor)
    staging = Staging(data)
    work = context.current().backend.recv(staging.buffer, src, tag, group)

    def finish():
        staging.copy_back()
        return tensor if as_numpy else data

    return complete(work, finish, async_op)


def barrier(group: Group | None = None) -> None:
    """Return once every rank of the group has called it.

    Args:
        group: a `td.new_group`/mesh group (None: the world).

    Raises:
        CollectiveMismatchError: a rank is in another collective, not this barrier (its
            subclass DivergedError when a rank skipped one; the ranks' calls named).
        ValueError: this rank is not a member of `group`.
        WatchdogTimeout: a rank did not arrive within the timeout.
    """
    check_member(group)
    checks.agree_on_call("barrier", group)  # is every rank in this barrier?
    context.current().backend.barrier(group).wait(context.current().timeout)


def broadcast_object(obj: Any = None, root: int = 0, group: Group | None = None) -> Any:
    """`root`'s picklable object, on every rank.

    Args:
        obj: the object to send, on `root` (ignored elsewhere).
        root: the global rank whose object is sent.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        An unpickled copy of `root`'s object (on `root` too).

    Raises:
        ValueError: `root` is not a rank of `group`, or this rank is not a member.
        pickle.PicklingError: `obj` cannot be pickled.
    """
    check_member(group)
    check_rank("root", root, group)
    if context.current().world.rank == root:
        payload = exchange.pickled(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload, length = None, torch.zeros(1, dtype=torch.int64)
    length = broadcast(length, root, group=group)
    if payload is None:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    payload = broadcast(payload, root, group=group)
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, group: Group | None = None) -> list[Any]:
    """Every rank's picklable object, as a list in rank order.

    Args:
        obj: this rank's object; any picklable value, of any size.
        group: a `td.new_group`/mesh group (None: the world).

    Returns:
        A list of `size` unpickled objects, the i-th from the group's i-th rank.

    Raises:
        CollectiveMismatchError: a rank is in another collective, not this one (its subclass
            DivergedError when a rank skipped one).
        ValueError: this rank is not a member of `group`.
        RuntimeError: the ranks' code paths diverged so that another operation's message was
            read here.
    """
    check_member(group)
    payload = exchange.pickled(obj)
    checks.agree_on_call("allgather_object", group, payload)
    return exchange.objects(payload, group, context.current())
