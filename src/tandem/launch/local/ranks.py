"""This machine's ranks (a fixed attempt, or an elastic round's workers): what each runs, what it
gets, and their exits as events.

Every kind of job starts its local ranks here, by `LocalRanks.start` through
`processes.start_ranks`: a fixed job's attempt on each node (a plain single-node job, a
restartable one, a multi-node one) and an elastic job's workers (with `TANDEM_ELASTIC_*`);
`mpiexec.MPIExecRanks` starts the same ranks through mpiexec instead. A rank gets this Python
running the script or module (`rank_command`), our environment plus thread limits and tandem's
`sitecustomize` (`job_environment`, `rank_site/`), and its place in the whole job
(`rank_environment`): global rank, world size, the rendezvous store, `TANDEM_RESTART=<attempt>`,
torchrun's variables (`environments.torchrun_variables`: RANK, MASTER_PORT...), and on
multi-node jobs the network interface Gloo should use. Exits arrive as
`events.RankExited` on the supervisor's queue.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.job.environments import horovod_variables, tandem_variables, torchrun_variables
from tandem.launch.config import LaunchConfig, StartError
from tandem.launch.events import RankExited
from tandem.launch.local.output import RankOutput, block_agent_signals
from tandem.launch.local.processes import (
    cores,
    groups_connected_to,
    signal_group,
    start_failure_code,
    start_ranks,
)

MASTER_ADDR = "127.0.0.1"
# Put first on every rank's PYTHONPATH: its sitecustomize imports tandem (see rank_site/).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what `thread_limits` sets
RANK_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rank_site")


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks sit in one attempt of the job (node 0 decides, tells everyone)."""

    attempt: int
    offset: int  # global rank of this node's first rank
    world: int
    store: tuple[str, int]
    store_key: str = field(repr=False)  # what the ranks prove to the store (rendezvous.server)
    gloo_interface: str | None = None
    # torchrun's rendezvous for unchanged torch.distributed scripts (`torchrun_variables`):
    # a free port on node 0 where rank 0's TCPStore will listen, and the job's run id.
    torch_port: int | None = None
    run_id: str = ""
    node: int = 0  # this node's index (GROUP_RANK) among `nodes`
    nodes: int = 1

    @classmethod
    def single(cls, np: int, port: int, store_key: str) -> Placement:
        """A one-node job of `np` ranks around a store on this machine's `port`."""
        return cls(attempt=0, offset=0, world=np, store=(MASTER_ADDR, port), store_key=store_key,
                   torch_port=free_port(MASTER_ADDR), run_id=new_run_id())


def free_port(host: str = "") -> int:
    """A port nothing listens on now, for rank 0's torch TCPStore (torchrun's MASTER_PORT).

    The operating system picks it; it is released at once for rank 0 to bind, so two jobs on
    one machine never share one (another process could take it in between, as with torchrun's
    own choice: rank 0 then fails to bind and names the port).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def new_run_id() -> str:
    """TORCHELASTIC_RUN_ID: one per job, the same on every node (node 0 makes it)."""
    return f"tandem-{secrets.token_hex(6)}"


def rank_command(config: LaunchConfig) -> list[str]:
    """The command line of every rank: this Python running the script or module, or the
    command as given (`tandem run -np 2 python train.py`)."""
    if config.executable:
        return [shutil.which(config.program) or config.program, *config.args]
    if config.module:
        return [sys.executable, "-u", "-m", config.program, *config.args]
    return [sys.executable, "-u", config.program, *config.args]


def thread_limits(base: Mapping[str, str], ranks_here: int,
                  per_rank: int | None = None) -> dict[str, str]:
    """The one thread rule of every rank tandem starts (`tandem run`'s, `td.spawn`'s and
    `tandem.testing`'s worlds): OMP_NUM_THREADS and MKL_NUM_THREADS are `per_rank` when given;
    else what `base` already says; else the machine's cores shared among the `ranks_here`
    ranks on it (N ranks each running one thread per core would oversubscribe it N times)."""
    threads = str(per_rank or max(1, cores() // max(1, ranks_here)))
    return {name: threads for name in THREAD_VARIABLES if per_rank is not None or name not in base}


def local_rank_environment(base: Mapping[str, str], *, rank: int, size: int, local_rank: int,
                           local_size: int, store: tuple[str, int], store_key: str | None = None,
                           backend: str | None = None, threads: int | None = None,
                           under_mpi: bool = False, torch: dict | None = None) -> dict[str, str]:
    """The one rank-environment builder: `base`, the thread rule (`thread_limits`, `threads`
    per rank when given) and a rank's place in the job, in tandem's, horovodrun's and (with
    `torch`: node, nodes, master_port, run_id, restart, max_restarts) torchrun's variables:
    rank `rank` of `size`, `local_rank` of the `local_size` ranks on this machine, the store at
    `store` that the launcher hosts (`under_mpi`: a rank that MPI wires). The worker pool of
    `td.spawn` and `tandem.testing` (`pool.WorkerPool`) starts its ranks with it as it is;
    `tandem run` adds the job's own variables (`rank_environment`), and each MPI rank's
    supervisor its place as mpiexec gave it (`mpi.rank`)."""
    place = dict(rank=rank, size=size, local_rank=local_rank, local_size=local_size)
    env = dict(base)
    env.update(thread_limits(base, local_size, threads))
    if torch is not None:
        env.update(torchrun_variables(**place, master_addr=store[0], **torch))
    env.update(tandem_variables(**place, master_addr=store[0], master_port=store[1],
                                store_hosted=True, backend=backend, under_mpi=under_mpi,
                                store_key=store_key))
    env.update(horovod_variables(**place))
    return env


def job_environment(config: LaunchConfig, base: Mapping[str, str]) -> dict[str, str]:
    """What every rank gets whoever starts it (us, or mpiexec): timeout, threads, unbuffered."""
    env = dict(base)
    env.pop("TANDEM_SECRET", None)  # the agents' secret is none of the ranks' business
    if config.timeout is not None:
        env["TANDEM_TIMEOUT"] = str(config.timeout)
    if config.timeline is not None:
        env["TANDEM_TIMELINE"] = os.path.abspath(config.timeline)
    env.update(thread_limits(base, config.np, config.threads_per_rank))
    env["PYTHONUNBUFFERED"] = "1"
    # A script that uses torch.distributed alone gets tandem's binding of rank 0's store to
    # MASTER_ADDR and tells the launcher that it joined (`rank_site`, `launch.local.joined`).
    paths = [path for path in base.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join([RANK_SITE, *(p for p in paths if p != RANK_SITE)])
    return env


def rank_environment(config: LaunchConfig, local: int, placement: Placement,
                     base: Mapping[str, str], nproc: int | None = None,
                     rank: int | None = None) -> dict[str, str]:
    """The environment of this node's rank `local` (of `nproc`, default `config.np`):
    `job_environment` plus its place in the job: global rank `rank`, by default the node's
    offset + `local` (an elastic job's new worker takes a free local slot instead)."""
    torch = None if placement.torch_port is None else dict(
        node=placement.node, nodes=placement.nodes, master_port=placement.torch_port,
        run_id=placement.run_id, restart=placement.attempt, max_restarts=config.max_restarts)
    env = local_rank_environment(
        job_environment(config, base), rank=placement.offset + local if rank is None else rank,
        size=placement.world, local_rank=local, local_size=nproc or config.np,
        store=placement.store, store_key=placement.store_key, backend=config.backend,
        threads=config.threads_per_rank, torch=torch)
    env["TANDEM_RESTART"] = str(placement.attempt)
    if placement.gloo_interface and "GLOO_SOCKET_IFNAME" not in base:
        env["GLOO_SOCKET_IFNAME"] = placement.gloo_interface
    return env


class LocalRanks:
    """The ranks this machine runs (`start`): a fixed job's attempt, or an elastic job's
    workers, started in groups whenever a round adds some; exits become `RankExited` events."""

    # Where the ranks name peers that did not answer their watchdog, reports 1, 2... (an
    # elastic MPI job's: `shrinking.ShrinkingRanks`); None: they report no such thing here.
    silent_key = None

    def __init__(self, config: LaunchConfig, events: queue.SimpleQueue, output: RankOutput,
                 nproc: int | None = None) -> None:
        self.config, self._events, self.output = config, events, output
        self.nproc = config.np if nproc is None else nproc
        self.pids: dict[int, int] = {}  # global rank -> pid (also its process group id)
        self.live: set[int] = set()
        self.store_port: int | None = None  # the job's store, which td.init() connects to

    def start(self, placement: Placement, workers: list[int] | None = None,
              slots: list[int] | None = None, number: int | None = None) -> None:
        """Start ranks `placement.offset`, ... of a world of `placement.world`: a fixed job's
        attempt (this node's `nproc` ranks in local slots 0, 1, ...; an earlier attempt's are
        forgotten), or an elastic job's new `workers` on local `slots` for round `number` (-1:
        a round that will add them once they are ready; `td.init()` reads its place from the
        store's current round anyway). Output and events name each by its id: its global rank,
        a worker's id (its rank when the job started)."""
        if workers is None:
            workers = [placement.offset + local for local in range(self.nproc)]
            slots = list(range(self.nproc))
        if number is None:
            self.pids, self.live = {}, set()
        local_size = max([self.nproc, *(slot + 1 for slot in slots)])  # slots offered later
        low, high = self.config.min_np or 1, self.config.max_np or self.config.np
        envs = []
        for index, (worker, slot) in enumerate(zip(workers, slots, strict=True)):
            env = rank_environment(self.config, slot, placement, os.environ, local_size,
                                   rank=placement.offset + index)
            if number is not None:
                env.update(TANDEM_ELASTIC_ROUND=str(number), TANDEM_ELASTIC_WORKER=str(worker),
                           TANDEM_ELASTIC_RANGE=f"{low}:{high}")
            elif self.output.terminal_rank(worker):
                env["TANDEM_TERMINAL"] = "1"  # its bars may redraw in place (see launch.local.output)
            envs.append(env)
        self._launch(placement, workers, envs)

    def _launch(self, placement: Placement, ids: list[int], envs: list[dict[str, str]]) -> None:
        """Start one rank per environment, named by `ids`, and watch them."""
        self.store_port = placement.store[1]
        command = rank_command(self.config)
        try:
            processes = start_ranks(command, envs)
        except OSError as error:  # checked before (programs.py), yet the system said no
            raise StartError(f"could not start {command[0]}: {error.strerror or error}",
                             code=start_failure_code(error)) from None
        for rank, proc in zip(ids, processes, strict=True):
            self.watch(rank, proc.pid, proc.stdout, proc.stderr, proc.wait)

    def watch(self, rank: int, pid: int, stdout, stderr, wait) -> None:
        """Copy a started rank's output; report its exit code (`wait()`'s result) as an event."""
        self.pids[rank] = pid
        self.live.add(rank)
        self.output.attach(rank, stdout, stderr)
        threading.Thread(target=self._wait, args=(rank, wait), daemon=True,
                         name=f"tandem-rank{rank}-wait").start()

    def _wait(self, rank: int, wait) -> None:
        block_agent_signals()
        self._events.put(RankExited(rank, wait()))

    def exited(self, rank: int) -> None:
        self.live.discard(rank)

    def signal(self, signum: int, ranks: set[int] | None = None) -> None:
        """`signum` to the process group of each live rank (of `ranks`, default all)."""
        for rank in sorted(self.live if ranks is None else self.live & ranks):
            signal_group(self.pids[rank], signum)

    def starting(self) -> set[int]:
        """The live ranks still starting (importing, most likely): none of their processes
        holds a connection to the job's store, which `td.init()` opens and keeps, and they
        printed nothing on stdout. Read from /proc when asked (on a signal), never polled."""
        quiet = {rank for rank in self.live if rank not in self.output.spoke}
        if not quiet or self.store_port is None:
            return quiet
        reached = groups_connected_to({self.pids[rank] for rank in quiet}, self.store_port)
        return {rank for rank in quiet if self.pids[rank] not in reached}

    def reap(self) -> None:
        """Kill what is left of every rank's process group (children the ranks started)."""
        for pid in self.pids.values():
            signal_group(pid, signal.SIGKILL)

    def close(self) -> None:
        """After the job: release what started the ranks (nothing here; mpiexec for MPI)."""
