"""`launch(config)`: decide the backend, pick the front end that runs a `LaunchConfig`, and
check what it needs.

Without `--backend` (or TANDEM_BACKEND) the backend is `default_backend(config)`, the one
choice the ranks make too (`settings.choose_backend`): NCCL with GPUs, else MPI when it can run
this job, else Gloo. MPI jobs go to `mpiexec.launch`; Gloo and NCCL jobs, local or with
`--max-restarts`, `--nnodes`, remote hosts (`-H node1:4`) or an elastic range
(`--min-np/--max-np`), to the one agent (`multinode.launch`; a plain local job is its case of
one machine, no restarts and min = max).
Nothing here imports torch: the machine is probed without it (`cuda_available`), and the
rendezvous store is hosted once the ranks are started.

`--resume-on-preempt N` (`resumed`) runs the job again when it exits EXIT_PREEMPTED (75: its
ranks saved at the step they agreed on), up to N times: the script restores its newest
checkpoint. Two signals to this process during one attempt (the second kills the ranks at once:
the previous checkpoint stands), or one while it restarts, stop it for good.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import signal
import sys
import threading
from contextlib import contextmanager

from tandem.job import settings
from tandem.job.preemption import EXIT_PREEMPTED
from tandem.launch.config import LaunchConfig, LaunchError, check_program
from tandem.launch.mpi import mpiexec, shm, shrinking


def cuda_available() -> bool:
    """Whether the ranks will see a GPU, asking torch only when the machine has an NVIDIA one."""
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/proc/driver/nvidia/gpus/*"):
        return False  # no NVIDIA device: no need to load torch to know
    import torch  # a GPU is there; is this torch built for it?

    return torch.cuda.is_available()


def mpi_usable() -> bool:
    """mpi4py is importable and an `mpiexec` can be found to start the ranks."""
    if importlib.util.find_spec("mpi4py") is None:
        return False
    try:
        mpiexec.find_mpiexec()
    except LaunchError:
        return False
    return True


def default_backend(config: LaunchConfig, cuda: bool | None = None, mpi: bool | None = None) -> str:
    """The backend of a job that names none: `nccl` with GPUs, else `mpi`, else `gloo`.

    MPI is the faster CPU engine (benchmarks/allreduce.py: 5-66x Gloo's bus bandwidth up to
    16 MB here; 1.46x on the data-parallel MLP), so it is chosen whenever it can run the job:
    mpi4py and an `mpiexec` are installed, and the job is one local agent without restarts.
    `tandem run --backend mpi` does not yet do restarts, `--nnodes` or `-H/--hostfile`
    (mpiexec.launch), so those jobs run on Gloo. `cuda` and `mpi` override the probes (tests).
    """
    local_only = (not config.hosts and config.nnodes == 1 and config.max_restarts == 0
                  and not config.elastic)
    return settings.choose_backend(
        None,
        cuda=cuda_available() if cuda is None else cuda,
        mpi=local_only and (mpi_usable() if mpi is None else mpi),
        mpi_job=local_only,
    )


def with_backend(config: LaunchConfig) -> LaunchConfig:
    """`config` with its backend decided: --backend, else TANDEM_BACKEND, else the default."""
    if config.backend is not None:
        return config
    try:
        named = settings.current().backend
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return dataclasses.replace(config, backend=named or default_backend(config))


def launch(config: LaunchConfig) -> int:
    """Run the job `config` describes; return its exit code (0, or the first failing rank's).
    With `--resume-on-preempt N`, a job that exits 75 (preempted) is run again (`resumed`)."""
    if config.resume_on_preempt:
        return resumed(config)
    return launch_once(config)


def resumed(config: LaunchConfig) -> int:
    """Run the job until it ends otherwise than preempted (exit 75), restarting it up to
    `config.resume_on_preempt` times. Each attempt is the same job (`launch_once`): the same
    ranks, or what -np/--min-np allow; the script restores its newest checkpoint itself.

    The signals this process hears are counted through a wakeup file descriptor (the C-level
    handler writes one byte per signal, whichever Python handler the attempt's agent set), so
    the agent's own handling is untouched: the first signal of an attempt is the preemption
    (passed on to the ranks, which save and exit 75); a second one in the same attempt, or any
    while restarting, stops for good (exit 75: the newest checkpoint stands)."""
    limit, restarts = config.resume_on_preempt, 0
    with _signals_counted() as heard:
        while True:
            code = launch_once(config)
            signals = heard()
            if code != EXIT_PREEMPTED:
                return code
            why = None
            if len(signals) > 1:
                names = " then ".join(signal.Signals(s).name for s in signals)
                why = f"tandem run received {names}: a second signal stops for good"
            elif os.environ.get("SLURM_JOB_ID"):
                why = (f"under SLURM (job {os.environ['SLURM_JOB_ID']}) the job requeues itself "
                       f"(rank 0 asks scontrol requeue) and this allocation is ending")
            elif restarts >= limit:
                why = (f"it was restarted {restarts} time(s) already (--resume-on-preempt "
                       f"{limit}); raise N to restart more")
            if why is None and heard():  # a signal while restarting: stop for good
                why = "a signal reached tandem run while it restarted the job"
            if why is None:
                restarts += 1
                _say(f"tandem run: preempted; starting the job again ({restarts} of {limit}, "
                     f"--resume-on-preempt {limit}): it resumes from its newest checkpoint")
            else:
                _say(f"tandem run: preempted; not restarting: {why}. The newest checkpoint "
                     f"stands; exit {EXIT_PREEMPTED}")
                return EXIT_PREEMPTED


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _signals_counted():
    """While inside, `heard()` returns the signals this process received since its last call.
    Between attempts (no agent running) SIGINT/SIGTERM/SIGHUP/SIGUSR1/2 are only noted."""
    if threading.current_thread() is not threading.main_thread():
        yield list  # signals reach the main thread only: nothing to count here
        return
    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    os.set_blocking(writer, False)
    noted = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    previous = {s: signal.signal(s, lambda signum, frame: None) for s in noted
                if signal.getsignal(s) is not signal.SIG_IGN}
    old_fd = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)

    def heard() -> list[int]:
        try:
            return list(os.read(reader, 4096))
        except BlockingIOError:
            return []

    try:
        yield heard
    finally:
        signal.set_wakeup_fd(old_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        os.close(reader)
        os.close(writer)


def launch_once(config: LaunchConfig) -> int:
    """One run of the job `config` describes; its exit code."""
    # Decided here, once, and handed to every rank as TANDEM_BACKEND: td.init() then agrees
    # with the front end that started the ranks (mpiexec or not).
    config = with_backend(config)
    if config.master is not None and config.nnodes == 1 and not config.hosts \
            and not (config.max_restarts and config.backend != "mpi"):
        raise LaunchError(
            "--master {}:{} is for jobs of several nodes (--nnodes N) or with restarts: a "
            "1-node job hosts its rendezvous on 127.0.0.1 at a free port itself. Drop --master "
            "(or unset TANDEM_MASTER)".format(*config.master))
    check_program(config)
    # What a killed `tandem run` could not remove (a job that ends removes its own).
    removed, size = shm.remove_stale()
    if removed:
        print(f"tandem run: {shm.describe_removed(removed, size)}", file=sys.stderr, flush=True)
    if config.backend == "mpi":  # elastic: the world shrinks when ranks fail (Open MPI's ULFM)
        return (shrinking.launch if config.elastic else mpiexec.launch)(config)
    from tandem.launch.agents import multinode  # the one agent: local, restarts, nodes, elastic

    return multinode.launch(config)
