"""`td.errors`: every error and warning tandem raises for a user to catch, in one place.

    try:
        td.allreduce(t)
    except td.errors.DivergedError as error:    # a rank called another collective
        ...

Each class lives beside the code that raises it; this module names them all, loaded on first use
(`import tandem.errors` imports no torch). The ones users catch most are also at the top level:
`td.CollectiveMismatchError`, `td.DivergedError`, `td.PeerUnreachableError`, `td.WatchdogTimeout`,
`td.CheckpointError`. Horovod's own errors stay in `tandem.horovod`.

Collectives and the wire:
    CollectiveMismatchError   the ranks called different collectives or passed different arguments
    DivergedError             a rank took another path through the program (a skipped call)
    LayoutMismatchError       tensors of one call laid out differently on the ranks
    GroupMismatchError        the ranks built different groups or meshes
    MessageMismatchError      a torch.distributed recv of another size or dtype than was sent
    BackendMismatchError      torch.distributed's backend "tandem" asked for what it cannot be
    UnsupportedOperation      a torch.distributed call backend "tandem" does not provide
    WatchdogTimeout           a wait passed its deadline; says who waited for whom
    PeerUnreachableError      a rank died or its host is unreachable
Splitting a model:
    GradientLayoutError       the ranks' gradients differ in layout (data parallelism)
    ReplicaStartWarning       the replicas started from different parameters
    ReplicaMismatchError      the replicas hold different parameters (`td.check_replicas`)
    ReplicaBufferWarning      the replicas hold different buffers
    ScheduleError             a pipeline schedule that cannot run
    ContextParallelError      a model that context parallelism cannot split
    SequenceSplitError        a sequence that cannot be split over the group
State, metrics, jobs:
    CheckpointError           a checkpoint that cannot be saved or restored
    CorruptCheckpointError    a damaged checkpoint (checksum, truncated file)
    MetricMismatchError       the ranks logged different metrics
    WorldChanged              an elastic job's world changed under a step
    StateMismatchError        an elastic state that the ranks disagree on
    Preempted                 `Checkpointer.save` saved on a preemption signal: exit, resume me
    SpawnError                a rank of `td.spawn` failed
    DistributedTestError      a rank of `tandem.testing.run_distributed` failed
Launching (`tandem run`, its store, its commands):
    LaunchError, StartError   a job that cannot be launched, a rank that did not start
    StoreTimeout, AuthenticationFailed, RendezvousError, PortInUseError
                              the job's store: no answer, a wrong token, a rendezvous that failed,
                              a port taken
    ScaleError, ModelSpecError  `tandem scale` / `tandem memory` given what they cannot run
"""

from __future__ import annotations

import importlib
from typing import Any

# module -> the error and warning classes it defines
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tandem.bench.scaling": ("ScaleError",),
    "tandem.checkpoint.durable": ("CheckpointError", "CorruptCheckpointError"),
    "tandem.cli.memory_report": ("ModelSpecError",),
    "tandem.comm.agreement.agree": ("CollectiveMismatchError", "DivergedError", "LayoutMismatchError"),
    "tandem.comm.groups": ("GroupMismatchError",),
    "tandem.comm.torch_pg.p2p": ("MessageMismatchError",),
    "tandem.comm.torch_pg.register": ("BackendMismatchError",),
    "tandem.comm.torch_pg.work": ("UnsupportedOperation",),
    "tandem.comm.watchdog.watched": ("PeerUnreachableError", "WatchdogTimeout"),
    "tandem.diagnostics.replicas": ("ReplicaBufferWarning", "ReplicaMismatchError"),
    "tandem.elastic.state": ("StateMismatchError", "WorldChanged"),
    "tandem.job.preemption": ("Preempted",),
    "tandem.launch.config": ("LaunchError", "StartError"),
    "tandem.metrics.means": ("MetricMismatchError",),
    "tandem.parallel.context.apply": ("ContextParallelError",),
    "tandem.parallel.context.layout": ("SequenceSplitError",),
    "tandem.parallel.data_parallel.reducer_front": ("GradientLayoutError",),
    "tandem.parallel.operation_check": ("ReplicaStartWarning",),
    "tandem.parallel.pipeline.schedules": ("ScheduleError",),
    "tandem.rendezvous.auth": ("AuthenticationFailed",),
    "tandem.rendezvous.client": ("StoreTimeout",),
    "tandem.rendezvous.roll_call": ("RendezvousError",),
    "tandem.rendezvous.server": ("PortInUseError",),
    "tandem.spawning": ("SpawnError",),
    "tandem.testing": ("DistributedTestError",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem.errors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
