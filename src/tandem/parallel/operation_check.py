"""One agreement per operation of a model: ranks whose code paths diverged are named, not mixed.

MPI and Gloo match collectives by their order alone. A rank that skips an optimizer step or a
backward (`if not torch.isfinite(loss): continue` on that rank only), or calls
`model.state_dict()` alone, would have its next message met by the others' gradient bucket,
all-gather or reduce-scatter: summed with it, or read as its data (wrong numbers first, a crash
in the engine or a hang later). So every operation that communicates without an argument check
of its own opens, before its first collective, with the same fixed-size agreement message that
every checked collective sends (`tandem.comm.agreement.agree`):

- a gradient round of the data-parallel reducer (`td.DistributedOptimizer`,
  `td.DistributedDataParallel`), posted at the round's first gradient (it travels while
  backward computes) and finished before the first bucket;
- each forward, backward, pipeline step and state-dict call of a split model (fully_shard's
  root, a model converted by `td.parallelize`, `td.tensor.Branches`, a `td.Pipeline`).

One class for both (`OperationCheck`), one message layout:

    (a model's operation, the model's layout, which operation, how many of it this rank made
     since the ranks last agreed, optimizer steps, training forwards, a detail that must match
     (an input's shapes), the parameters' checksum at the first operation, what a gradient
     round is weighted by (0: 1/size, or a sample count's unit: samples.py), whether this rank
     heard a preemption signal (tandem.job.preemption))

Ranks in the same operation agree and the data follows. A rank elsewhere meets the others in
another operation or at another count: every rank raises one `DivergedError` naming each
rank's operation (in debug mode also the line of the user's code that ran it), before any data
is sent. The message is one all-reduce of a few hundred bytes per operation. Not made (`make`
gives None) on a group of one rank, with checks off, or where the backend takes no CPU tensor
(NCCL: a host synchronisation per step that the bare model does not make).
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import fingerprints
from tandem.comm.agreement.agree import DivergedError
from tandem.comm.groups import Group, group_rank, group_ranks, group_size
from tandem.job import preemption
from tandem.parallel.layout import splits

_KIND = agreement.checksum("model operation")
# The codes' places in the message (the same for every operation): the kind, the layout, the
# operation, its count, optimizer steps, training forwards, then
_DETAIL = 6  # what must match within an operation (an input's shapes): named when it differs
_WEIGHTS = 7  # the parameters' checksum at the first operation: may differ (a warning)
_WEIGHTING = 8  # what a gradient round is weighted by (samples.py): must match
_STOP = 9  # a rank heard a preemption signal: may differ, read as MAX
_TOLERATED = (_DETAIL, _WEIGHTS, _STOP)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class _OperationCodes(dict):
    """operation -> its checksum, computed once (a dictionary look-up per agreement)."""

    def __missing__(self, operation: str) -> int:
        code = self[operation] = agreement.checksum(operation)
        return code


_OPERATION_CODES = _OperationCodes()

#: The calls every rank must make together, whatever it then does with the result, and the fix.
CALLS = {
    "state_dict": "model.state_dict() (td.fsdp.full_state_dict(model) too) gathers the model from "
                  "every rank: every rank calls it, then rank 0 alone saves (`state = "
                  "model.state_dict()` on every rank, `if td.rank() == 0: torch.save(state, path)`).",
    "full_optimizer_state_dict": "td.fsdp.full_optimizer_state_dict gathers the optimizer's state "
                                 "from every rank: every rank calls it, then rank 0 alone saves.",
}


class ReplicaStartWarning(UserWarning):
    """The ranks' parameters differed when training started (no broadcast_parameters)."""


def agreeing(group: Group | None) -> bool:
    """Whether operations over `group` open with an agreement: more than one rank, checks on,
    and a backend that takes CPU tensors (on NCCL it would be a host synchronisation)."""
    state = runtime.state()
    return (state.checks and group_size(group) > 1
            and state.backend.supports_device(torch.device("cpu")))


class OperationCheck:
    """The per-operation agreement of one model (None-safe: see `make`).

    `post` sends an operation's agreement early, to travel while this rank computes; `agree`
    finishes it (or sends and finishes it at once) before the operation's first collective.
    Counters that other code keeps current: `steps` (optimizer steps over the model: counted
    by the optimizer-step hook for the `stepped` parameters, or by the wrapper that steps),
    `forwards` (training forwards, by `td.DistributedDataParallel`).
    """

    def __init__(self, wrapper: str, owner: str, layout: int, group: Group | None,
                 stepped: Sequence[torch.Tensor] = (), advice: str | None = None, *,
                 weights: Sequence[torch.Tensor] = (), carries_stop: bool = False) -> None:
        self.wrapper, self.owner, self._layout, self._group = wrapper, owner, layout, group
        self._advice = advice  # the fix for a rank that skipped (default: agreement.SKIP_ADVICE)
        self._weights_of = weights  # checksummed once, at the first operation (see `_weights`)
        self._carries_stop = carries_stop  # the preemption flag travels with each operation
        self.counts: dict[str, int] = {}  # operation -> how many this rank has agreed on
        self.steps = 0
        self.forwards = 0
        self._weighting = 0  # the next operation's (see samples.py)
        self._posted: tuple[str, agreement.Posted] | None = None
        self._backward_due = False
        self.param_ids = frozenset(id(p) for p in stepped)
        if self.param_ids:  # the optimizer-step hook counts the steps over them
            splits.count_steps(self)

    @staticmethod
    def make(wrapper: str, owner: str, lines: Iterable[str], group: Group | None,
             stepped: Iterable[torch.Tensor] = (), advice: str | None = None, *,
             weights: Sequence[torch.Tensor] = (), carries_stop: bool = False,
             ) -> OperationCheck | None:
        """The check of a model over `group` whose layout `lines` describe, or None where
        operations are not agreed on (`agreeing`).

        Args:
            wrapper: what split the model, as the error names it ("fully_shard"; "" for the
                data-parallel reducer, whose operation says it).
            owner: the model's name in the error (its class, a stage).
            stepped: parameters whose optimizer steps are counted into `steps` for you.
            advice: the fix for a rank that skipped (default: `agreement.SKIP_ADVICE`).
            weights: parameters checksummed at the first operation; ranks that differ get a
                `ReplicaStartWarning`.
            carries_stop: the operation carries the preemption flag (`tandem.job.preemption`).
        """
        if not agreeing(group):
            return None
        return OperationCheck(wrapper, owner, agreement.checksum(list(lines)), group,
                              list(stepped), advice, weights=weights, carries_stop=carries_stop)

    def rebase(self) -> None:
        """After `td.join()`: the ranks ran different numbers of operations, on purpose; the
        counts start again from here."""
        self.counts.clear()
        self.steps = self.forwards = 0

    def _codes(self, operation: str, detail: str | None) -> list[int]:
        return [_KIND, self._layout, _OPERATION_CODES[operation], self.counts.get(operation, 0),
                self.steps, self.forwards, 0 if detail is None else agreement.checksum(detail),
                self._weights() if self._weights_of else 0, self._weighting,
                preemption.requested() if self._carries_stop else 0]

    def send(self, operation: str, weighting: int = 0) -> agreement.Posted:
        """Send `operation`'s agreement now; `agree(operation, posted=...)` finishes it.
        `weighting`: what this gradient round is weighted by (samples.py), which must match."""
        self._weighting = weighting
        return agreement.post(self._codes(operation, None), self._group, runtime.state())

    def post(self, operation: str) -> None:
        """Send `operation`'s agreement now, to travel while this rank computes; the next
        `agree` finishes it, before the operation's first collective."""
        if self._posted is None and runtime.state().checks:
            self._posted = (operation, self.send(operation))

    def agree(self, operation: str, detail: str | None = None,
              explain_detail: Callable[[tuple[int, ...], list], str] | None = None,
              posted: agreement.Posted | None = None) -> None:
        """Every rank of the group must be in this same operation, at the same count, after as
        many optimizer steps and training forwards (and with the same `detail`, else
        `explain_detail` says why). `posted`: this operation's agreement, already sent by
        `send`; one sent by `post` is found here."""
        engine = runtime.state()
        if self._posted is not None:  # sent: finished whatever happened since (checks turned off)
            (was, sent), self._posted = self._posted, None
            if was == operation:
                posted = sent
            else:  # posted, then another operation came first: finish it as sent
                self.agree(was, posted=sent)
        if not engine.checks and posted is None:
            return
        number, steps, forwards, weighting = (self.counts.get(operation, 0) + 1, self.steps,
                                              self.forwards, self._weighting)
        site = user_site() if engine.debug else None

        def mine() -> str:  # put into words only on a disagreement
            return self._describe(operation, number, steps, forwards, weighting, site)

        codes = posted.codes if posted is not None else self._codes(operation, detail)
        try:
            differ = agreement.agree(mine, self._group, error=DivergedError, explain=_explain,
                                     codes=None if posted is not None else codes,
                                     tolerated=_TOLERATED, engine=engine, posted=posted)
        except TimeoutError as error:  # the watchdog's report: who arrived, every rank's stack
            raise type(error)(
                f"{mine()}: rank {engine.world.rank} waited {engine.timeout:g} s (the timeout) for "
                f"the ranks {list(group_ranks(self._group))} to start it too; one did not (it "
                f"failed, stopped, or skipped this call)\n{error}") from None
        self.counts[operation] = number
        if self._carries_stop:  # the flags' MAX: set on some rank (they differ) or on all (mine)
            preemption.carried(_STOP in differ or bool(codes[_STOP]))
        if differ:
            self._tolerate(operation, differ, detail, explain_detail, engine)

    def _describe(self, operation: str, number: int, steps: int, forwards: int, weighting: int,
                  site: str | None) -> str:
        """This rank's operation, as the error names it: `fully_shard forward #3 of Net (after
        2 optimizer steps)`, `gradient reduction #2 of DistributedOptimizer (after 1 optimizer
        steps), weighted by its samples (uneven batches)`, `state_dict #1 of Net (fully_shard)`."""
        call = operation in CALLS
        text = (f"{operation} #{number} of {self.owner}" if call or not self.wrapper
                else f"{self.wrapper} {operation} #{number} of {self.owner}")
        notes = [self.wrapper] if call and self.wrapper else []
        notes += [f"after {steps} optimizer steps"] if steps else []
        notes += [f"after {forwards} training forwards"] if forwards else []
        text += f" ({', '.join(notes)})" if notes else ""
        text += ", weighted by its samples (uneven batches)" if weighting else ""
        text += f" at {site}" if site else ""
        if call:
            return agreement.Described(text, CALLS[operation])
        return agreement.Described(text, self._advice) if self._advice else text

    def _tolerate(self, operation, differ, detail, explain_detail, engine) -> None:
        """The same operation, with a tolerated code differing: different starting weights
        warn; a different detail (an input's shapes) is named."""
        if _WEIGHTS in differ and group_rank(self._group) == 0:
            warnings.warn(
                f"{self.owner}: the replicas start from different weights (the parameters' "
                "checksums differ across ranks at the first step): call "
                "td.broadcast_parameters(model) before training (and "
                "td.broadcast_optimizer_state(opt) after loading a checkpoint on one rank), or "
                "seed every rank alike", ReplicaStartWarning, stacklevel=3)
        if _DETAIL in differ:
            details = agreement.everyone(detail, self._group, engine)
            ranks = group_ranks(self._group)
            raise agreement.CollectiveMismatchError(
                explain_detail(ranks, details) if explain_detail else
                f"{self.wrapper} {operation} of {self.owner}: " + "; ".join(
                    f"rank {r}: {d}" for r, d in zip(ranks, details, strict=True)))

    def _weights(self) -> int:
        """A checksum of the parameters' bytes, at the first operation only (one pass over them)."""
        params, self._weights_of = self._weights_of, ()
        crc = 0
        for p in params:
            crc = zlib.crc32(p.detach().cpu().reshape(-1).view(torch.uint8).numpy(), crc)
        return crc

    def answer(self) -> None:
        """On a rank out of data (`td.join()`): take part in the others' agreement, without a
        say in it; a disagreement among them is raised here too."""
        engine = runtime.state()
        if engine.checks:
            agreement.agree("out of data, answering in td.join()", self._group,
                            codes=agreement.ANY, error=DivergedError, explain=_explain,
                            engine=engine)

    # -- backward: posted at its first gradient, finished before its first collective --------
    def expect_backward(self) -> None:
        """A training forward ended: its backward opens with an agreement."""
        self._backward_due = True

    def backward_starts(self) -> None:
        """The first gradient of the model's output arrived: send the backward's agreement."""
        if self._backward_due:
            self.post("backward")

    def before_backward_collective(self) -> None:
        """About to communicate in backward: finish the backward's agreement (once)."""
        if self._backward_due:
            self._backward_due = False
            self.agree("backward")

    def open_backward(self) -> None:
        """Send and finish the backward's agreement at once (layers whose collectives are
        issued where this check cannot see them)."""
        self.backward_starts()
        self.before_backward_collective()

    def forward_starts(self, detail: str | None = None, explain_detail=None) -> None:
        """A forward: agreed. A training forward also replaces a backward still due (one never
        run); an evaluation forward (no gradients) leaves it due."""
        if torch.is_grad_enabled():
            self._backward_due = False
        self.agree("forward", detail, explain_detail)


def _explain(ranks, calls) -> str:
    lines = "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
    return ("the ranks are in different operations of a model, or at different steps of it "
            f"(nothing was sent):\n{lines}\n{agreement.advice_of(calls)}")


def user_site() -> str:
    """Where the user's code ran backward or called the model (debug mode): the innermost
    frame of neither tandem nor torch."""
    frame = sys._getframe(2)
    while frame is not None and (fingerprints.is_tandem_frame(frame)
                                 or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return fingerprints.site_of(frame)
