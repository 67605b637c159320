"""tandem's engines as a torch.distributed process group: what DDP, FSDP2, DTensor and pipelining call.

`TandemProcessGroup` is a Python subclass of `torch.distributed.ProcessGroup` (as torch's own
`test_c10d_pypg.py` and torchft's process groups are): torch's Python functions
(`dist.all_reduce`, `dist.gather`, `dist.all_gather_into_tensor`...) call these methods by
name, and its C++ callers (DDP's reducer, the functional collectives of DTensor and FSDP2)
reach the overridable ones through pybind's trampoline. Each method translates torch's
arguments (lists of tensors, group-local roots, `ReduceOp`s) into one call of tandem's engine
protocol (`backend.Backend`: global roots, in place, contiguous) on the engine `td.init` or
`init_process_group` created, already wrapped by the watchdog, and returns a `TandemWork`.

Argument checks: a call from torch's Python API (`dist.all_reduce(t)`, the user's own
collective) runs tandem's argument check (`comm.agreement.checks`: one small agreement; shapes, dtypes,
ops and roots that differ between ranks are an error naming each rank's call, never garbage)
before it sends when it blocks, with its work when `async_op=True` (read at `wait()`), unless
checks are off (`TANDEM_CHECKS=0`). What DDP, FSDP2, DTensor and pipelining send from C++
(shapes known from their layouts) goes straight to the engine; DDP's backward gets one
agreement per round. Collectives complete in order, and point-to-point messages carry their
size and dtype: `torch_order` and `torch_p2p` say how.

Sub-groups: torch hands `new_group` to the default group itself when that group has a
`new_group` method, on every rank of the world, members or not; here that call is agreed
first (`groups.agree_on`: a rank that asks for other ranks is named, never a hang inside the
engine), then the engine creates its sub-communicator for the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import constants

from tandem.comm import context, groups
from tandem.comm.agreement import checks
from tandem.comm.engines.backend import Backend, Group, Work, on_wire
from tandem.comm.torch_pg import order as torch_order
from tandem.comm.torch_pg import p2p as torch_p2p
from tandem.comm.torch_pg.order import InOrder, Rounds
from tandem.comm.torch_pg.work import TandemWork, UnsupportedOperation, reduce_op, seconds
from tandem.job import settings
from tandem.rendezvous.torch_store import LONGEST_WAIT_S


class Place:
    """What the agreement reads of this process's place (`context.Context.world`)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device


class EngineContext:
    """The engine of a process group as comm's agreement sees it (a `context.Context`)."""

    def __init__(self, engine: Backend, timeout: float, device: torch.device) -> None:
        self.world = Place(engine.rank, engine.size, device)
        self.backend, self.timeout = engine, timeout
        chosen = settings.current()
        self.checks, self.debug = chosen.checks, chosen.debug


def _blocking(opts: Any) -> bool:
    """torch's Python wrappers say `asyncOp=False` for a blocking call; its C++ callers (DDP,
    functional collectives) leave the default, True, and wait on the Work themselves."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


def _op(opts: Any) -> Any:
    return getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM


class TandemProcessGroup(dist.ProcessGroup):
    """One group of ranks (the world, or a sub-group) on a tandem engine."""

    def __init__(self, engine: Backend, group: Group | None, name: str, timeout: float,
                 device: torch.device, owner: Any = None) -> None:
        members = group.ranks if group is not None else tuple(range(engine.size))
        rank = group.rank if group is not None else engine.rank
        super().__init__(rank, len(members))
        self.engine, self.group, self.members = engine, group, members
        self._name, self._timeout, self._device = name, timeout, device
        self._owner = owner  # what shutdown() releases: the engine, when this group made it
        self._in_order = InOrder()  # collectives complete in order, as on Gloo (`torch_order`)
        self._posted: list = []  # checks of this call's asynchronous work, for `_work`
        self.rounds = Rounds()  # DDP's per-backward agreement
        torch_order.count_ddp_forwards(TandemProcessGroup)

    # -- what torch asks of every process group ------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._name

    # torch keeps a group's name and description in its backends; this group has none.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, description: str) -> None:  # noqa: N802 - torch's name
        self._group_desc = description

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return getattr(self, "_group_desc", "")

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices torch asks this group about (`_get_pg_default_device`, DCP's
        `broadcast_from_rank0`, `_device_capability`): the device of its engine, as Gloo
        answers [cpu] and NCCL [cuda]. torch reads it from the C++ backends a group registered;
        this group registers none, it is its own backend."""
        return [torch.device(self._device.type)]

    def __repr__(self) -> str:
        return f"TandemProcessGroup({self._name}, ranks={list(self.members)}, engine={self.engine.name})"

    def _global(self, group_rank: int, role: str) -> int:
        if not 0 <= group_rank < len(self.members):
            raise ValueError(f"{role}={group_rank} is outside the group of {len(self.members)} ranks")
        return self.members[group_rank]

    def _wire(self, tensor: torch.Tensor, keep: bool = True) -> tuple[torch.Tensor, Any]:
        """A contiguous buffer the engine takes for `tensor`, and the step that copies a result
        back into `tensor` (None when the buffer is the tensor itself)."""
        if tensor.is_contiguous() and self.engine.supports_device(tensor.device):
            return tensor, None
        buffer = on_wire(tensor, self.engine, keep_values=keep).contiguous()
        return buffer, (lambda: tensor.copy_(buffer))

    def _check(self, opts: Any, collective: str, tensor: torch.Tensor | None = None, *,
               op: str | None = None, root: int | None = None, ignore_dim0: bool = False) -> None:
        """The argument check of a call from torch's Python API (the module docstring says why
        only those): now when it blocks; posted with the work of an async_op=True call."""
        if len(self.members) == 1:
            return
        if not _blocking(opts):
            if tensor is not None and torch_order.from_python_api():
                self._posted += torch_order.post_check(collective, tensor, self.group,
                                                       self._context(), op, root, ignore_dim0)
            return
        engine = self._context()
        if tensor is None:
            checks.agree_on_call(collective, self.group, engine=engine)
        else:
            checks.agree(collective, tensor, self.group, op=op, root=root,
                         ignore_dim0=ignore_dim0, engine=engine)

    def _context(self) -> Any:
        if context.installed() and context.current().backend is self.engine:
            return context.current()  # td.init's, with its checks and debug switches
        return EngineContext(self.engine, self._timeout, self._device)

    def _flat(self, n: int, like: torch.Tensor) -> torch.Tensor:
        device = like.device if self.engine.supports_device(like.device) else self.engine.staging_device
        return torch.empty(n, dtype=like.dtype, device=device)

    def _work(self, works: Sequence[Work], result: Any, steps: Sequence[Any] = (),
              source: int = -1, opts: Any = None, ordered: bool = True) -> TandemWork | None:
        """The operation's `TandemWork`; or, for a blocking call from torch's Python API
        (`opts.asyncOp` False), the operation finished here and None, which torch takes as
        "already synchronised": no Work object to build for the commonest call."""
        steps = [step for step in steps if step is not None]
        posted, self._posted = self._posted, []
        if _blocking(opts):
            self._in_order.finish_all(self._timeout)
            for work in works:
                work.wait(self._timeout)
            for step in steps:
                step()
            return None
        after = (lambda: [step() for step in steps]) if steps else None
        check = (posted[0] if len(posted) == 1 else (lambda: [c() for c in posted])) \
            if posted else None
        return TandemWork(works, self._timeout, result, after, source, check,
                          self._in_order if ordered else None)

    # -- reductions -----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TandemWork:
        works, steps = [], []
        blocking = _blocking(opts)
        for tensor in tensors:
            name, mean = reduce_op(_op(opts), tensor.dtype, "all_reduce")
            self._check(opts, "all_reduce", tensor, op="avg" if mean else name)
            buffer, back = self._wire(tensor)
            if blocking:  # small messages finish on the spot (`Backend.allreduce_now`)
                work = self.engine.allreduce_now(buffer, name, self.group)
                works += [work] if work is not None else []
            else:
                if not self._posted and len(self.members) > 1:  # DDP's: one per backward,
                    self.rounds.agree(self.group, self._context)  # before its first bucket
                works.append(self.engine.allreduce(buffer, name, self.group))
            steps += [self._mean(buffer) if mean else None, back]
        return self._work(works, tensors, steps, opts=opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TandemWork:
        return self.allreduce(tensors, opts)

    def _mean(self, buffer: torch.Tensor):
        return lambda: buffer.div_(len(self.members))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TandemWork:
        (tensor,) = tensors
        name, mean = reduce_op(_op(opts), tensor.dtype, "reduce")
        root = self._global(opts.rootRank, "dst")
        self._check(opts, "reduce", tensor, op="avg" if mean else name, root=root)
        buffer, back = self._wire(tensor)
        work = self.engine.reduce(buffer, root, name, self.group)
        mine = root == self.engine.rank
        return self._work([work], tensors, [self._mean(buffer) if mean and mine else None,
                                            back if mine else None], opts=opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> TandemWork:
        (output,), (parts,) = outputs, inputs
        if len(parts) != len(self.members):
            raise ValueError(f"reduce_scatter: {len(parts)} inputs for a group of "
                             f"{len(self.members)}; give one per rank")
        flat = torch.cat([part.reshape(-1) for part in parts])
        return self.reduce_scatter_single(output, flat, opts, "reduce_scatter")

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None,
                              collective: str = "reduce_scatter_tensor") -> TandemWork:
        name, mean = reduce_op(_op(opts), input.dtype, collective)
        if input.numel() != output.numel() * len(self.members):
            raise ValueError(f"{collective}: the input has {input.numel()} elements; it must have "
                             f"{len(self.members)} x the output's {output.numel()}")
        self._check(opts, collective, input, op="avg" if mean else name)
        source, _ = self._wire(input)
        buffer, back = self._wire(output, keep=False)
        work = self.engine.reducescatter_into(buffer.view(-1), source.reshape(-1), name, self.group)
        steps = [self._mean(buffer) if mean else None, back]
        return self._work([work], [output], steps, opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> TandemWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(works, outputs, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TandemWork:
        root = self._global(opts.rootRank if opts is not None else 0, "src")
        works, steps = [], []
        for tensor in tensors:
            self._check(opts, "broadcast", tensor, root=root)
            mine = root == self.engine.rank
            buffer, back = self._wire(tensor, keep=mine)
            works.append(self.engine.broadcast(buffer, root, self.group))
            steps.append(None if mine else back)
        return self._work(works, tensors, steps, opts=opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> TandemWork:
        (parts,), (input,) = outputs, inputs
        self._check_parts("all_gather", parts, input)
        self._check(opts, "all_gather", input)
        flat = self._flat(len(parts) * input.numel(), input)
        source, _ = self._wire(input)
        work = self.engine.allgather_into(flat, source.reshape(-1), self.group)
        return self._work([work], outputs, [self._unpack(flat, parts)], opts=opts)

    def _check_parts(self, collective: str, parts: list[torch.Tensor], one: torch.Tensor) -> None:
        if len(parts) != len(self.members):
            raise ValueError(f"{collective}: {len(parts)} tensors for a group of "
                             f"{len(self.members)}; give one per rank")
        if any(p.numel() != one.numel() or p.dtype != one.dtype for p in parts):
            raise UnsupportedOperation(
                f"{collective} of tensors of different sizes or dtypes: the tandem backend moves "
                "equal parts; pad them to one size (or use all_gather_object)")

    @staticmethod
    def _unpack(flat: torch.Tensor, parts: list[torch.Tensor]):
        def step() -> None:
            n = parts[0].numel() if parts else 0
            for i, part in enumerate(parts):
                part.copy_(flat[i * n:(i + 1) * n].view_as(part))
        return step

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> TandemWork:
        if output.numel() != input.numel() * len(self.members):
            raise ValueError(f"all_gather_into_tensor: the output has {output.numel()} elements; "
                             f"it must have {len(self.members)} x the input's {input.numel()}")
        self._check(opts, "all_gather_into_tensor", input)
        source, _ = self._wire(input)
        buffer, back = self._wire(output, keep=False)
        work = self.engine.allgather_into(buffer.view(-1), source.reshape(-1), self.group)
        return self._work([work], [output], [back], opts=opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> TandemWork:
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(works, outputs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> TandemWork:
        works = [self.allgather([o], [i]) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(works, outputs, opts=opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> TandemWork:
        (input,) = inputs
        root = self._global(opts.rootRank, "dst")
        self._check(opts, "gather", input, root=root)
        source, _ = self._wire(input)
        if root != self.engine.rank:
            work = self.engine.gather(None, source.reshape(-1), root, self.group)
            return self._work([work], [], opts=opts)
        parts = outputs[0]
        self._check_parts("gather", parts, input)
        flat = self._flat(len(parts) * input.numel(), input)
        work = self.engine.gather(flat, source.reshape(-1), root, self.group)
        return self._work([work], outputs, [self._unpack(flat, parts)], opts=opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> TandemWork:
        (output,) = outputs
        root = self._global(opts.rootRank, "src")
        self._check(opts, "scatter", output, root=root)
        flat = None
        if root == self.engine.rank:
            self._check_parts("scatter", inputs[0], output)
            flat = self._wire(torch.cat([p.reshape(-1) for p in inputs[0]]))[0]
        buffer, back = self._wire(output, keep=False)
        work = self.engine.scatter(buffer.view(-1), flat, root, self.group)
        return self._work([work], outputs, [back], opts=opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_splits: list[int], input_splits: list[int],
                          opts: Any = None) -> TandemWork:
        n = len(self.members)
        self._check(opts, "all_to_all_single", input, ignore_dim0=True)  # splits may differ
        output_splits = list(output_splits) or [output.shape[0] // n] * n
        input_splits = list(input_splits) or [input.shape[0] // n] * n
        source, _ = self._wire(input)
        buffer, back = self._wire(output, keep=False)
        work = self.engine.alltoall_into(buffer, source, output_splits, input_splits, self.group)
        return self._work([work], [output], [back], opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> TandemWork:
        if len(outputs) != len(self.members) or len(inputs) != len(self.members):
            raise ValueError(f"all_to_all: give {len(self.members)} input and output tensors, "
                             "one per rank")
        flat_in = self._wire(torch.cat([t.reshape(-1) for t in inputs]))[0]
        flat_out = self._flat(sum(t.numel() for t in outputs), outputs[0])
        work = self.engine.alltoall_into(flat_out, flat_in, [t.numel() for t in outputs],
                                         [t.numel() for t in inputs], self.group)

        def unpack() -> None:
            offset = 0
            for t in outputs:
                t.copy_(flat_out[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return self._work([work], outputs, [unpack], opts=opts)

    # -- point to point and barrier --------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TandemWork:
        (tensor,) = tensors
        buffer, _ = self._wire(tensor)
        works = torch_p2p.send(self.engine, tensor, buffer, self._global(dst, "dst"), tag,
                               self.group)
        return self._work(works, tensors, ordered=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TandemWork:
        (tensor,) = tensors
        buffer, back = self._wire(tensor, keep=False)
        work, check = torch_p2p.recv(self.engine, tensor, buffer, self._global(src, "src"), tag,
                                     self.group, self._timeout)
        self._posted += [check] if check is not None else []  # the header, read at wait()
        return self._work([work], tensors, [back], source=src, ordered=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> TandemWork:
        raise UnsupportedOperation(
            "recv without src (from any rank) is not supported by the tandem backend: the "
            "watchdog must know whom a receive waits for. Pass src=, e.g. dist.recv(t, src=0)")

    def barrier(self, opts: Any = None) -> TandemWork:
        self._check(opts, "barrier")
        return self._work([self.engine.barrier(self.group)], [], opts=opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """torch's `monitored_barrier` (Lightning's `rank_zero_first` waits in one): a barrier
        that waits `timeout` (else the group's); a rank that does not come is named by the
        watchdog, as in every wait, so `wait_all_ranks` changes nothing."""
        limit = seconds(timeout, self._timeout)
        self._in_order.finish_all(limit)
        self.engine.barrier(self.group).wait(limit)

    # -- groups and lifetime --------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], timeout: Any = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None):
        """torch's `new_group`, handed to the default group on every rank of the world."""
        members = tuple(int(r) for r in ranks)
        context = EngineContext(self.engine, self._timeout, self._device)
        groups.agree_on(f"dist.new_group({list(members)})", context)
        handle = self.engine.new_group(members)
        me = self.engine.rank
        if me not in members:
            return None
        group = Group(members, handle, members.index(me))
        made = TandemProcessGroup(self.engine, group, self._name, self._wait_limit(timeout),
                                  self._device)
        # torch finds a group by this name in its registry (DeviceMesh's `_resolve_process_group`
        # for every dimension of a mesh): Gloo's groups carry it from their options.
        made.setGroupName(group_name or "")
        made.setGroupDesc(group_desc or "")
        return made

    def _wait_limit(self, timeout: Any) -> float:
        """A sub-group's timeout: the one `new_group` was given, up to `LONGEST_WAIT_S` (20 days:
        Lightning's barrier group asks for 10,000), else this group's. torch fills in its default
        (30 minutes) when none was given: that stays tandem's (TANDEM_TIMEOUT)."""
        if timeout is None or timeout in (constants.default_pg_timeout,
                                          constants.default_pg_nccl_timeout):
            return self._timeout
        return min(seconds(timeout, self._timeout), LONGEST_WAIT_S)

    def shutdown(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner()

    def abort(self) -> None:
        self.shutdown()
