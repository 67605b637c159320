"""`td.Pipeline`: one model split into stages across the ranks of a group, GPipe or 1F1B.

    pipe = td.Pipeline(nn.Sequential(...), chunks=8, schedule="1f1b")   # on every rank
    loss = pipe.train_step(x, y, loss_fn)   # x read on the first stage, y on the last
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)                    # this stage's only

Rank i of the group (the world by default) is stage i and keeps only its layers: given an
`nn.Sequential` (built on every rank), the other stages' layers are moved to the meta device,
which frees them; given a list of stage modules or of factories (zero-argument callables), only
this rank's is kept or built. `named_parameters()` uses the original names (`3.weight`).

A step splits the batch into `chunks` micro-batches along dim 0 (uneven sizes allowed, as
`torch.tensor_split`), runs the schedule of `tandem.parallel.pipeline.schedules` and leaves in
`.grad` (added, as `loss.backward()` does) the gradient of the full-batch loss. Scaling rule: with
`reduction="mean"` (the default), `loss_fn` must return the mean over its micro-batch and
micro-batch i's loss is weighted by rows_i / rows, so the weighted sum is the full-batch mean
for any split; with `reduction="sum"`, losses are added unweighted. The returned loss is that
sum, on the last stage (None elsewhere, or on every rank with `broadcast_loss=True`, as a
float64 scalar).

Messages: each step opens with one agreement over the group (`parallel/operation_check.py`: the
call, train_step or forward, how many of it each stage made, and the optimizer steps over its
parameters), so a stage in another call, or one that skipped its optimizer step (`if
torch.isnan(loss): continue` on the last stage alone), raises `td.DivergedError` on every stage,
naming each; then a per-step 32-byte header flows down the pipeline (the step's shape
signature, or the first stage's refusal of a bad batch so that every stage raises instead of
hanging, and whether the first stage trains or evaluates: with checks off, the header alone
tells a stage in the other call). A stage that skips a whole iteration (train_step and
optimizer step) is paired with the others' next one, and is named when it leaves the job
first. With checks off, stages out of step in any other way wait for each other around a cycle,
which the watchdog proves and reports within seconds (comm/monitor). Shapes and
dtypes of each edge are sent once per new signature and cached; afterwards only tensors travel.
Edge shapes must depend only on the input's shapes (no data-dependent shapes between stages).

`balance`: None (even layer counts), a list of layer counts, "params" (even parameter counts)
or "time" (even forward+backward time, profiled at construction on the first stage's rank on
`sample=`, an input batch; the split is then shared with the other stages).

Data × pipeline: `mesh = td.mesh(dp=2, pp=2)`, `Pipeline(..., group=mesh.pp_group)`, and
`td.DistributedOptimizer(opt, named_parameters=pipe.named_parameters(), group=mesh.dp_group)`:
every parameter gets one backward pass per micro-batch; the step runs all but the last with
the optimizer's reducer paused (as `no_sync()`), so the gradients are averaged across replicas
once, during the last (see `executor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tandem import runtime
from tandem.comm.agreement.agree import DivergedError
from tandem.comm.collectives import direct
from tandem.comm.collectives import user as collectives
from tandem.comm.groups import Group, group_rank, group_ranks, group_size
from tandem.diagnostics import timeline
from tandem.parallel.layout import split_grads, splits
from tandem.parallel.layout.owner import ModuleOwner, register
from tandem.parallel.operation_check import OperationCheck
from tandem.parallel.pipeline import balance as balancing
from tandem.parallel.pipeline import build as building
from tandem.parallel.pipeline.edges import HEADER_TAG, Link
from tandem.parallel.pipeline.executor import PipelineStats, StageSetup, StepRunner
from tandem.parallel.pipeline.schedules import Schedule, build_schedule, format_grid

__all__ = ["Pipeline", "PipelineStats"]

_OK, _NEW, _ERROR = 0, 1, 2
_SKIP_ADVICE = (
    "A stage took a different code path from the others (for example `if torch.isnan(loss): "
    "continue` on the last stage, the only one that has the loss). Decide together: "
    "`loss = pipe.train_step(x, y, loss_fn, broadcast_loss=True)` gives the loss to every "
    "stage, so that `if not torch.isfinite(loss): continue` skips the step on all of them.")
#: Shape signatures remembered before the caches start over (variable-length inputs).
_MAX_SIGNATURES = 64


class Pipeline:
    """This rank's stage of a pipeline-parallel model; see the module docstring.

    Args:
        module: an `nn.Sequential` built on every rank (split by `balance`), or a list of stage
            modules or of factories (zero-argument callables), one per rank of the group.
        chunks: the micro-batches each step splits the batch into (a positive int).
        schedule: "1f1b" (the default: at most `stages - stage_index` micro-batches held) or
            "gpipe" (every forward, then every backward).
        balance: None (even layer counts), a list of layer counts per stage, "params" (even
            parameter counts) or "time" (even forward+backward time, profiled on `sample`).
        group: the pipeline's ranks, rank i of it stage i (`mesh.pp_group`; default: the
            world).
        sample: an input batch, for `balance="time"`.
        device: where this stage computes (default `td.device()`).

    Raises:
        ValueError: this rank is not in `group`, `chunks` is not a positive int, an unknown
            schedule or balance, a split that leaves a stage empty, or stages that share a
            layer (tied weights); raised on every rank, naming the failing stage.
        TypeError: a stage factory returned something other than an `nn.Module`.
        CollectiveMismatchError: the ranks passed other arguments (each rank's named).
    """

    def __init__(
        self,
        module: nn.Sequential | Sequence[nn.Module | Callable[[], nn.Module]],
        chunks: int = 8,
        schedule: str = "1f1b",
        balance: None | Sequence[int] | str = None,
        group: Group | None = None,
        *,
        sample=None,
        device: torch.device | str | None = None,
    ) -> None:
        state = runtime.state()
        self._backend, self._timeout, self._group = state.backend, state.timeout, group
        self._ranks = group_ranks(group)
        self.stage_index = group_rank(group)
        self.num_stages = len(self._ranks)
        if self.stage_index < 0:
            raise ValueError(
                f"rank {runtime.rank()} is not in the pipeline group {list(self._ranks)}: build "
                f"the Pipeline only on the ranks of its group"
            )
        self.chunks, self.schedule_kind = chunks, schedule
        self.device = torch.device(device) if device is not None else runtime.device()
        # Every rank checks its arguments, then the ranks compare notes once: an error on any
        # rank is raised on all of them (none is left waiting), with the failing rank named.
        counts, error = None, None
        try:
            if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
                raise ValueError(f"chunks must be a positive int (micro-batches per step), got {chunks!r}")
            if schedule not in ("1f1b", "gpipe"):
                raise ValueError(f"unknown schedule {schedule!r}: choose '1f1b' or 'gpipe'")
            counts = building.plan(module, balance, sample, self.num_stages, self.stage_index)
        except Exception as caught:  # shared with every rank below
            error = caught
        mine = building.describe_arguments(module, chunks, schedule, balance, counts)
        counts = building.agree_on_plan(mine, error, group, self._ranks, balance)
        stage = prefix = others = None
        error = None
        try:
            stage, prefix, others = building.select(module, counts, self.stage_index)
        except Exception as caught:  # shared with every rank below
            error = caught
        building.settle(error, group, self._ranks, "could not build its stage")
        building.free(others)
        self.stage, self._prefix = stage, prefix
        if self.num_stages > 1:  # the stage's own tensors: norms and clipping reduce over stages
            for param in stage.parameters():
                if splits.split_of(param) is None:
                    splits.mark(param, splits.PIPELINE, group)
                    split_grads.mark_grads(param)
        self.stage.to(self.device)
        self.balance = counts
        # A stage that starts with an in-place op (ReLU(inplace=True)) would write into the
        # received leaf tensor autograd needs; it gets a copy instead.
        self._copy_inputs = balancing.starts_in_place(self.stage)
        self.schedule: Schedule = build_schedule(schedule, self.num_stages, chunks)
        self._forward_schedule: Schedule | None = None
        self._link = Link(self._backend, group, self._timeout, self._describe)
        self._setup = StageSetup(self.stage, self.stage_index, tuple(self._ranks), self.device,
                                 self._link, self._copy_inputs)
        self._signatures: dict[tuple, int] = {}  # first stage: shape signature -> id
        self._specs_in: dict[int, list] = {}
        self._specs_out: dict[int, list] = {}
        self._broken = False
        self.stats = PipelineStats()
        owner = type(module).__name__ if isinstance(module, nn.Module) else "stages"
        self._check = OperationCheck.make(
            "Pipeline", f"{owner}, stage {self.stage_index}",
            [f"ranks {list(self._ranks)}", f"balance {counts}", f"chunks {chunks} {schedule}"],
            group, self.stage.parameters(), advice=_SKIP_ADVICE)
        timeline.configure()

    # -- public -----------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under the original model's names (`3.weight`)."""
        for name, param in self.stage.named_parameters():
            yield self._prefix + name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.stage.parameters()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's own entries, under the whole model's names."""
        return {self._prefix + k: v for k, v in self.stage.state_dict().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, every stage's entries gathered (collective: every
        rank of the pipeline calls it), as `model.state_dict()` of a fully_shard or
        tensor-parallel model is; never one stage's alone (`local_state_dict()` is that)."""
        mine = {key: value.detach().cpu().clone()
                for key, value in self.local_state_dict().items()}
        if group_size(self._group) == 1:
            return mine
        merged: dict[str, torch.Tensor] = {}
        for part in collectives.allgather_object(mine, group=self._group):
            merged.update(part)
        return merged

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def compile(self, **options) -> Pipeline:
        """Compile this rank's stage with `torch.compile(**options)`; returns the pipeline.

        `nn.Module.compile()`'s spelling, for the stage this rank holds. The stage's forward is
        compiled, not `pipe.stage.compile()`: on an `nn.Sequential` (the stage of a split
        Sequential) torch 2.13's in-place compile captures nothing and silently runs eager.
        Names and state dict are unchanged; micro-batches of a new shape recompile once.
        """
        if "forward" in self.stage.__dict__ and hasattr(self.stage.forward, "_torchdynamo_orig_callable"):
            raise ValueError(f"{self!r} is already compiled; call compile() once")
        self.stage.forward = torch.compile(self.stage.forward, **options)
        return self

    def format_schedule(self) -> str:
        """The training schedule as a stage × step grid."""
        return format_grid(self.schedule)

    def train_step(self, x, y, loss_fn: Callable | None, *, reduction: str = "mean",
                   broadcast_loss: bool = False) -> torch.Tensor | None:
        """One forward and backward of a batch; returns the loss on the last stage (see module doc)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if self.is_last and (y is None or not callable(loss_fn)):
            raise ValueError(
                f"the last stage (rank {self._ranks[-1]}) needs the targets y and a loss_fn, got "
                f"y={type(y).__name__}, loss_fn={type(loss_fn).__name__}"
            )
        loss = self._step(x, y, loss_fn, reduction, train=True)
        if not broadcast_loss:
            return loss
        buffer = torch.zeros((), dtype=torch.float64)
        if loss is not None:
            buffer.fill_(float(loss))
        if self.num_stages > 1:
            work, staged = direct.broadcast_into(buffer, self._ranks[-1], self._group)
            work.wait(self._timeout)
            buffer = staged.cpu()
        return buffer

    @torch.no_grad()
    def forward(self, x):
        """Evaluation: the model's output for `x` (read on the first stage), on the last stage."""
        return self._step(x, None, None, "mean", train=False)

    __call__ = forward

    def __repr__(self) -> str:
        return (f"Pipeline(stage {self.stage_index} of {self.num_stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={self.schedule_kind!r})")

    # -- one step ---------------------------------------------------------------------------
    def _describe(self, rank: int | None) -> str:
        rank = self._ranks[self.stage_index] if rank is None else rank
        return f"stage {self._ranks.index(rank)} (rank {rank})"

    def _step(self, x, y, loss_fn, reduction: str, train: bool):
        if self._broken:
            raise RuntimeError(
                f"an earlier step failed on pipeline {self._describe(None)}, so its messages are "
                f"out of step with the other stages: build a new Pipeline"
            )
        start = time.perf_counter()
        if self._check is not None:  # every stage in this same call, after as many steps
            self._broken = True  # a timeout leaves the agreement unfinished: out of step
            self._check.agree("train_step" if train else "forward")
            self._broken = False
        sig, rows, fresh, micro_x = self._header(x, train)
        # From here on the stages exchange this step's messages; failing midway leaves them out
        # of step, so the pipeline refuses further steps.
        self._broken = True
        m = self.chunks
        sizes = [rows // m + (1 if i < rows % m else 0) for i in range(m)]
        targets = None
        if self.is_last and train:
            targets = _split(building.to_device(y, self.device), m, "y", expect_rows=rows)
        if self._forward_schedule is None and not train:
            self._forward_schedule = build_schedule("forward", self.num_stages, m)
        actions = (self.schedule if train else self._forward_schedule)[self.stage_index]
        runner = StepRunner(self._setup, self._specs_in[sig], self._specs_out[sig], fresh, train,
                            micro_x, targets, loss_fn,
                            [n / rows if reduction == "mean" else 1.0 for n in sizes])
        runner.run(actions)
        self._link.flush()
        self._broken = False
        self.stats = runner.stats
        self.stats.step_s = time.perf_counter() - start
        return runner.result()

    def _header(self, x, train: bool) -> tuple[int, int, bool, list | None]:
        """Agree on this step's shapes down the pipeline; raise everywhere for a bad batch."""
        prev = self._ranks[self.stage_index - 1] if not self.is_first else None
        nxt = self._ranks[self.stage_index + 1] if not self.is_last else None
        header = torch.zeros(4, dtype=torch.int64)
        micro_x, error = None, None
        if self.is_first:
            try:
                micro_x, rows, key = self._split_input(x, train)
                sig = self._signatures.get(key)
                status = _OK if sig is not None else _NEW
                if sig is None:
                    if len(self._signatures) >= _MAX_SIGNATURES:
                        self._signatures.clear()
                    sig = self._signatures[key] = len(self._signatures)
                header[:] = torch.tensor([status, sig, rows, int(train)])
            except (ValueError, TypeError) as caught:
                error = caught
                header[:] = torch.tensor([_ERROR, 0, _rows(x), int(train)])
        else:
            pending = self._link.recv((4,), torch.int64, self.device, prev, HEADER_TAG, "the step header")
            header = pending.wait().cpu()
        if nxt is not None:
            self._link.send(header.to(self.device), nxt, HEADER_TAG, "the step header")
        status, sig, rows, first_trains = header.tolist()
        if first_trains != train:  # sent on first: every later stage raises too
            self._link.flush()
            self._broken = True  # stage 0 goes on with its call: the messages are out of step
            modes = ("forward (evaluation)", "train_step")
            raise DivergedError(
                f"pipeline stages are in different calls: stage 0 (rank {self._ranks[0]}) runs "
                f"{modes[first_trains]}, {self._describe(None)} runs {modes[train]}. Every stage "
                "must call train_step, or forward, together (the same number of times, in the "
                "same order)"
            )
        if status == _ERROR:
            self._link.flush()
            if error is not None:
                raise error
            raise ValueError(
                f"stage 0 (rank {self._ranks[0]}) rejected the input batch of {rows} rows "
                f"(chunks={self.chunks}); see the error on that rank"
            )
        if status == _NEW:
            if sig == 0:  # the first stage started its signature table over
                self._specs_in.clear()
                self._specs_out.clear()
            self._specs_in[sig] = [None] * self.chunks
            self._specs_out[sig] = [None] * self.chunks
        elif sig not in self._specs_out:
            raise RuntimeError(f"pipeline {self._describe(None)} has no cached shapes for signature {sig}")
        return sig, rows, status == _NEW, micro_x

    def _split_input(self, x, train: bool):
        if x is None:
            raise ValueError(f"the first stage (rank {self._ranks[0]}) needs the input x, got None")
        x = building.to_device(x, self.device)
        micro = _split(x, self.chunks, "x")
        flat = [x] if isinstance(x, torch.Tensor) else list(x)
        key = (train, type(x).__name__, tuple((tuple(t.shape), t.dtype) for t in flat))
        return micro, flat[0].shape[0], key


def _rows(x) -> int:
    first = x if isinstance(x, torch.Tensor) else (x[0] if isinstance(x, (tuple, list)) and x else None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else -1


def _split(value, chunks: int, name: str, expect_rows: int | None = None) -> list:
    """`chunks` micro-batches along dim 0 (tensor_split sizes); tuples are split element-wise."""
    flat = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(flat, (tuple, list)) or not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError(f"{name} must be a tensor or a tuple/list of tensors, got {type(value).__name__}")
    rows = {t.shape[0] if t.dim() else None for t in flat}
    if len(rows) != 1 or None in rows:
        raise ValueError(f"the tensors of {name} must share their first (batch) dimension, got shapes "
                         f"{[tuple(t.shape) for t in flat]}")
    (n,) = rows
    if expect_rows is not None and n != expect_rows:
        raise ValueError(f"{name} has {n} rows but the input batch x has {expect_rows}")
    if n < chunks:
        raise ValueError(
            f"the batch has {n} rows, fewer than chunks={chunks}: every micro-batch needs at "
            f"least one row; pass a larger batch or a smaller chunks"
        )
    parts = [torch.tensor_split(t, chunks) for t in flat]
    if isinstance(value, torch.Tensor):
        return list(parts[0])
    return [type(value)(p[i] for p in parts) for i in range(chunks)]



class PipelineOwner(ModuleOwner):
    """What model-wide calls ask of a `td.Pipeline` (`parallel/layout/owner.py`): this rank's
    stage, under the whole model's names; the other stages' tensors are on their ranks."""

    kind = splits.PIPELINE

    def describe(self) -> str:
        pipe = self.obj
        return f"td.Pipeline stage {pipe.stage_index} of {pipe.num_stages}"

    @property
    def group(self) -> Any:
        return self.obj._group

    def module(self) -> nn.Module:
        return self.obj.stage

    def prefix(self) -> str:
        return self.obj._prefix

    def split_kinds(self) -> set[str]:
        return {splits.PIPELINE} | super().split_kinds()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.obj.state_dict()  # every stage's entries, gathered (copies already)

    def load_own_state(self, state: dict[str, torch.Tensor]) -> bool:
        """This rank's stage takes its own entries of the whole model's state dict."""
        pipe = self.obj
        local = list(pipe.local_state_dict())
        own = list(pipe.stage.state_dict())
        missing = [name for name in local if name not in state]
        if missing:
            raise ValueError(f"the state dict does not match the pipeline (built a different "
                             f"model?): missing {', '.join(missing)}, held by this rank's stage "
                             f"{pipe.stage_index}")
        pipe.stage.load_state_dict({key: state[name] for key, name in zip(own, local, strict=True)})
        return True


register(Pipeline, PipelineOwner)
