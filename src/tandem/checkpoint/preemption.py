"""The agreed stop at a step boundary: `td.preempted()`, and what `Checkpointer.save` asks.

    ckpt = td.Checkpointer("checkpoints")          # arms the handlers (tandem.job.preemption)
    for step in ...:
        ...train one step...
        ckpt.save(step, model=model, optimizer=opt, data=loader)
        # after a SIGTERM/SIGUSR1 on any rank: every rank saves after the SAME step and the
        # script ends with exit status 75 (td.Preempted, a SystemExit): "preempted, resume me"

Scripts without a Checkpointer ask `td.preempted()` after each step (every rank): True on every
rank at the same step once some rank heard the signal. The answer is free when the
data-parallel reducer's per-step agreement carried the flags since the last boundary; else one
small agreement message (the size of every agreement) is sent, only while the handlers are armed.
"""

from __future__ import annotations

from tandem import runtime
from tandem.comm.agreement import agree as agreement
from tandem.comm.groups import Group
from tandem.job import preemption

_KIND = agreement.checksum("preemption check")


def _explain(ranks, calls) -> str:
    return agreement.explain_diverged(ranks, [str(c) for c in calls])


def preempted(group: Group | None = None) -> bool:
    """True on every rank once some rank heard a preemption signal (or its walltime lead): stop
    after this step, save and exit (`td.Preempted`). Every rank calls it after every step.

    Args:
        group: the ranks that must agree (default: the world).

    Returns:
        Whether the ranks agreed to stop at this step boundary (the same on every rank).

    Raises:
        DivergedError: a rank is not at this check but in another operation (it skipped a step
            boundary, or called `td.preempted` on some ranks only).
    """
    preemption.arm()
    preemption.boundary()
    if preemption.agreed():
        return True
    if preemption.carried_since_last_boundary():  # the reducer's agreement told us, for free
        return preemption.agreed()
    flag = preemption.requested()
    if runtime.is_initialized() and runtime.size() > 1:
        differ = agreement.agree("the preemption check at a step boundary (td.preempted or "
                                 "Checkpointer.save)", group, explain=_explain,
                                 codes=[_KIND, flag], tolerated=(1,),
                                 error=agreement.DivergedError)
        flag = flag or int(1 in differ)
    preemption.agree_now(bool(flag))
    return preemption.agreed()
