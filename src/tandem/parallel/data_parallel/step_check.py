"""One agreement per gradient round: ranks whose code paths diverged are named, not averaged.

MPI and Gloo match collectives by their order alone. If one rank skips an optimizer step
(`if not torch.isfinite(loss): continue` on that rank only) or calls `td.broadcast` where
the others step, the others' gradient buckets would meet its next message and be summed with
it: wrong numbers first, a crash or the timeout later. So, when argument checks are on (the
default), the reducer opens every round with the same fixed-size agreement message that every
checked collective sends (`tandem.comm.agreement.agree`), carrying what the round is:

    (gradient reduction, the reducer's layout, rounds, training forwards, optimizer steps,
     what the round's gradients are weighted by: 0 (1/size) or a sample count's unit, samples.py;
     whether this rank heard a preemption signal: tandem.job.preemption)

Ranks in the same round agree and the buckets follow. A rank elsewhere (another collective,
another reducer, another step) disagrees, and every rank raises one `DivergedError` naming
each rank's operation (and in debug mode the line that ran backward). The message is one
all-reduce of a few hundred bytes per step, posted at the round's first gradient (it travels
while backward computes) and finished before the first bucket; on NCCL, where it
would be a host synchronisation per step that DDP does not make, it is not sent.
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib
from collections.abc import Sequence

import torch

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.agreement import fingerprints
from tandem.comm.agreement.agree import DivergedError
from tandem.comm.groups import Group, group_rank, group_size
from tandem.job import preemption

_KIND = agreement.checksum("gradient reduction")
_WEIGHTS = 5  # the code that may differ: a warning, not an error
_STOP = 7  # a rank heard a preemption signal (`tandem.job.preemption`): may differ, read as MAX


class ReplicaStartWarning(UserWarning):
    """The ranks' parameters differed when training started (no broadcast_parameters)."""
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class StepCheck:
    """The per-round agreement of one reducer (None-safe: see `make`)."""

    def __init__(self, owner: str, layout_code: int, group: Group | None,
                 params: Sequence[torch.Tensor] = ()) -> None:
        self._owner = owner
        self._params = params  # checksummed once, at the first round (see `_weights`)
        self._layout = layout_code
        self._group = group
        self.forwards = 0  # training forwards seen by DistributedDataParallel
        self.steps = 0  # optimizer steps taken by DistributedOptimizer
        self._base = (0, 0, 0)  # counts when the ranks last agreed to differ (td.join's end)
        self._weighting = 0  # this round's (see samples.py)

    def rebase(self, rounds: int) -> None:
        """After `td.join()`: ranks with uneven data ran different numbers of steps, on purpose."""
        self._base = (rounds, self.forwards, self.steps)

    @staticmethod
    def make(owner: str, lines: list[str], group: Group | None,
             params: Sequence[torch.Tensor] = ()) -> StepCheck | None:
        state = runtime.state()
        cpu = state.backend.supports_device(torch.device("cpu"))
        if group_size(group) == 1 or not state.checks or not cpu:
            return None
        return StepCheck(owner, agreement.checksum(lines), group, params)

    def _counts(self, rounds: int) -> tuple[int, int, int]:
        base_rounds, base_forwards, base_steps = self._base
        return rounds - base_rounds, self.forwards - base_forwards, self.steps - base_steps

    def _codes(self, rounds: int) -> list[int]:
        rounds, forwards, steps = self._counts(rounds)
        weights = self._weights() if self._params else 0
        return [_KIND, self._layout, rounds, forwards, steps, weights, self._weighting,
                preemption.requested()]

    def post(self, rounds: int, weighting: int = 0) -> agreement.Posted:
        """At the round's first gradient: send the agreement, to be finished by `agree`."""
        engine = runtime.state()
        self._weighting = weighting
        return agreement.post(self._codes(rounds), self._group, engine)

    def agree(self, rounds: int, posted: agreement.Posted | None = None) -> None:
        """Before the round's first bucket: every rank must be in this same round (`posted`:
        this round's agreement, already sent by `post`)."""
        engine = runtime.state()
        if not engine.checks:
            return
        site = user_site() if engine.debug else None
        base, forwards_now, steps_now = self._base, self.forwards, self.steps

        def mine() -> str:  # put into words only on a disagreement
            number, forwards, steps = (rounds - base[0], forwards_now - base[1],
                                       steps_now - base[2])
            counts = []
            if steps:
                counts.append(f"after {steps} optimizer steps")
            if forwards:
                counts.append(f"after {forwards} training forwards")
            text = f"gradient reduction #{number + 1} of {self._owner}"
            text += f" ({', '.join(counts)})" if counts else ""
            text += ", weighted by its samples (uneven batches)" if self._weighting else ""
            return text + (f" at {site}" if site else "")

        codes = posted.codes if posted else self._codes(rounds)
        differ = agreement.agree(mine, self._group, error=DivergedError, explain=_explain,
                                 codes=None if posted else codes,
                                 tolerated=(_WEIGHTS, _STOP), engine=engine, posted=posted)
        # The flags' MAX: set on some rank (they differ) or on all (this rank's is set).
        preemption.carried(_STOP in differ or bool(codes[_STOP]))
        if _WEIGHTS in differ and group_rank(self._group) == 0:
            warnings.warn(
                f"{self._owner}: the replicas start from different weights (the parameters' "
                "checksums differ across ranks at the first step): call "
                "td.broadcast_parameters(model) before training (and "
                "td.broadcast_optimizer_state(opt) after loading a checkpoint on one rank), or "
                "seed every rank alike", ReplicaStartWarning, stacklevel=2)

    def _weights(self) -> int:
        """A checksum of the parameters' bytes, at the first round only (one pass over them)."""
        params, self._params = self._params, ()
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


def _explain(ranks, calls) -> str:
    return ("the ranks are reducing the gradients of different steps (nothing was sent):\n"
            + "\n".join(f"  rank {r}: {c}" for r, c in zip(ranks, calls, strict=True))
            + "\n" + agreement.SKIP_ADVICE)


def user_site() -> str:
    """Where the user's code ran backward or called the model (debug mode): the innermost
    frame of neither tandem nor torch."""
    frame = sys._getframe(2)
    while frame is not None and (fingerprints.is_tandem_frame(frame)
                                 or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return fingerprints.site_of(frame)

