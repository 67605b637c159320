"""`self.log(name, value, sync_dist=True)` reduces the same name on every rank, or is refused.

Lightning hands the strategy's `reduce` the tensor alone: with rank 0 logging `val_loss` and
rank 1 `val_acc` at the same point, their values meet in one all-reduce, the same shape and
dtype, and rank 0's `callback_metrics["val_loss"]` became the mean of a loss and an accuracy,
rc 0. The name is one frame up: Lightning's result collection reduces each logged value from
its `_ResultMetric.update` (on_step) or `.compute` (on_epoch), whose `self.meta` says the name
and the hook (`validation_step`). `logged()` reads it there, by the code objects of those two
methods (a handful of identity tests per call, no dictionary of locals unless one matches).

`all_reduce` then agrees on the name, the hook and the call (shape, dtype, op) in the one
agreement message that `td.allreduce`'s argument check would have sent, and reduces straight
through the engine: the two messages of a checked all-reduce, as before. Ranks that log
different names raise `td.metrics.MetricMismatchError` on every rank, naming each rank's metric and
the fix, before anything is summed. With checks off (`td.init(checks=False)`) nothing is
compared, as for every collective.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from tandem.comm import context
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import checks
from tandem.comm.collectives import direct
from tandem.comm.members import group_size
from tandem.lightning import common
from tandem.metrics.means import MetricMismatchError

_KIND = agreement.checksum("tandem.lightning: self.log(sync_dist=True)")
_DEEPEST = 6  # frames from the strategy's reduce up to Lightning's _ResultMetric method
_methods: list = []  # the code objects of _ResultMetric.update and .compute, once imported


def _result_methods() -> tuple:
    if not _methods:
        try:
            from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
        except ImportError:  # another Lightning: no name, the call site check still applies
            _methods.append(())
        else:
            _methods.append((_ResultMetric.update.__code__, _ResultMetric.compute.__code__))
    return _methods[0]


def logged(depth: int = 2) -> str | None:
    """`self.log('val_loss') in validation_step` when Lightning's result collection is the
    caller (`depth` frames up from here, outward), else None."""
    methods = _result_methods()
    frame = sys._getframe(depth)
    for _ in range(_DEEPEST):
        if frame is None:
            return None
        if any(frame.f_code is method for method in methods):
            meta = getattr(frame.f_locals.get("self"), "meta", None)
            if meta is None:
                return None
            return f"self.log({meta.name!r}) in {meta.fx}"
        frame = frame.f_back
    return None


def all_reduce(tensor: Any, group: Any, reduce_op: Any, name: str) -> Any:
    """The strategy's `reduce` of the value logged as `name`: agreed on, then reduced."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    op = common.op_name(reduce_op)
    if op == "mean" and not tensor.is_floating_point():
        tensor = tensor.float()  # an integer mean would round down (tandem's integer rule)
    tgroup = common.tandem_group(group, "reduce")
    engine = context.current()
    if engine.checks and group_size(tgroup, engine) > 1:
        call = checks.describe("allreduce", tensor, op)
        agreement.agree(agreement.Described(f"{name}: {call}", _ADVICE), tgroup,
                        codes=[_KIND, agreement.checksum(name), agreement.checksum(call)],
                        error=MetricMismatchError, explain=explain, engine=engine)
    return direct.allreduce(tensor, op, tgroup)


_ADVICE = ("Log the same names with sync_dist=True, in the same order, on every rank: a name "
           "that only some ranks log must be logged without sync_dist (or on every rank).")


def explain(ranks: Sequence[int], calls: Sequence[str]) -> str:
    """The error when the ranks reduce different logged values at the same point."""
    lines = "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
    return ("ranks reduce different logged values in one self.log(..., sync_dist=True) "
            f"reduction (nothing was averaged):\n{lines}\n{_ADVICE}")
