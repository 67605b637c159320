"""One rank's supervisor under `tandem run --backend mpi` (internal; mpiexec runs it).

`mpiexec` starts one of these per rank; each starts the user's program as its child and
connects it to the `tandem run` agent over three local sockets (control, stdout, stderr):

    mpiexec -n N python -m tandem.launch.mpi.rank --connect 127.0.0.1:P1
        --store 127.0.0.1:P2 --torch-port P3 --run-id ID -- python -u train.py

The child inherits MPI's process-manager connection (MPICH's `PMI_FD` and friends, Open MPI's
`PMIX_*` variables; `close_fds=False` keeps inheritable descriptors), so `td.init()` in it
joins the MPI job as usual. Its environment is the job's, which the agent sends first thing on
the control socket (`env <bytes>` and JSON), with what mpiexec set on top: MPICH's gforker
is given only the few variables a supervisor needs to start (it refuses more than 193). It
also gets the same `TANDEM_*` variables as a locally started rank (its MPI rank, size and local
rank, the agent's rendezvous store at `--store`) plus `TANDEM_UNDER_MPI=1`: it is a tandem rank
that happens to be wired by MPI, so the watchdog's all-ranks reports, the timeline and scripts
that read `TANDEM_RANK` work as under Gloo, while `td.init()` still picks the MPI backend.
torchrun's variables come with them (RANK, MASTER_PORT=P3...), for torch.distributed scripts.

It runs in a session of its own, so the agent stops it (and whatever it started) by process
group, exactly like a locally started rank, and reads its output as it reads a local rank's
pipes. Each of the three connections first proves the job's launch token (`launch_port`, the
rendezvous store's handshake). On the control socket the supervisor says `pid <pid>` when the
child started (`error <code> <why>` when the system refused to start it) and `exit <code>` when
it ended (a negative code: killed by that signal); past the environment the agent never writes
there, so end of file means the agent is gone, and the supervisor then kills the child's group
(the rank's watchdog in turn ends the rank if the supervisor vanishes). It exits 0 itself
either way: deciding what a failure means (stop the others, the summary, the
job's exit code) is the agent's job, not mpiexec's. So it ignores mpiexec's own ways of
ending a job after one rank left without MPI_Finalize: Hydra's SIGUSR1 (with
-disable-auto-cleanup), and with `--forker` gforker's SIGINT then SIGQUIT a second later,
which no flag turns off.

It imports `tandem.job.environments`, `tandem.job.settings` and `tandem.launch` (with the rendezvous
store's handshake), which need no torch (the `tandem` package loads its names lazily), so
starting a rank's supervisor stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from tandem.job import environments, settings
from tandem.launch.config import parse_address
from tandem.launch.local.processes import signal_group, start_failure_code
from tandem.launch.local.ranks import local_rank_environment
from tandem.launch.mpi import launch_port
from tandem.rendezvous.auth import AuthenticationFailed

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORKER_KILLS = (signal.SIGINT, signal.SIGQUIT)  # gforker's MPIE_KillWorld, on an abnormal exit
CONNECT_TIMEOUT_S = 30.0
_ENV_HEADER_BYTES = 64


def _receive_environment(control: socket.socket) -> dict[str, str]:
    """The job's environment, as the agent sends it first on the control socket."""
    control.settimeout(CONNECT_TIMEOUT_S)
    try:
        header = b""
        while not header.endswith(b"\n"):
            chunk = control.recv(1)
            if not chunk or len(header) > _ENV_HEADER_BYTES:
                raise SystemExit(f"mpi_rank.py: no environment from the agent ({header!r})")
            header += chunk
        words = header.split()
        if len(words) != 2 or words[0] != b"env" or not words[1].isdigit():
            raise SystemExit(f"mpi_rank.py: no environment from the agent ({header!r})")
        size, data = int(words[1]), bytearray()
        while len(data) < size:
            chunk = control.recv(min(1 << 16, size - len(data)))
            if not chunk:
                raise SystemExit("mpi_rank.py: the agent left while sending the environment")
            data += chunk
    except OSError as error:
        raise SystemExit(f"mpi_rank.py: no environment from the agent: {error}") from None
    control.settimeout(None)
    return json.loads(data)


def _mpi_job(env):
    """This rank's place as mpiexec tells it (never from `TANDEM_*` or torchrun variables: those
    may be an enclosing job's)."""
    job = environments.detect_openmpi(env) or environments.detect_mpich(env)
    if job is None:
        raise SystemExit("mpi_rank.py: not started by mpiexec (neither OMPI_COMM_WORLD_RANK "
                         "nor PMI_RANK is set)")
    return job


def _child_environment(job, store: tuple[str, int], base, torch_port: int | None = None,
                       run_id: str = "") -> dict[str, str]:
    """`base` minus the launch token, plus a local rank's variables (`local_rank_environment`)
    and TANDEM_UNDER_MPI, and torchrun's around the agent's `torch_port` (rank 0's TCPStore)."""
    torch = None if torch_port is None else dict(node=0, nodes=1, master_port=torch_port,
                                                 run_id=run_id)
    env = local_rank_environment(
        {k: v for k, v in base.items() if k != "TANDEM_LAUNCH_TOKEN"}, rank=job.rank,
        size=job.size, local_rank=job.local_rank, local_size=job.local_size, store=store,
        backend="mpi", under_mpi=True, torch=torch)
    if base.get("TANDEM_MPI_ON_FAILURE") == "shrink":
        # An elastic MPI job (launch/mpi/shrinking.py): the worker id a rank keeps whatever
        # its rank after the world shrank, as an elastic Gloo job's workers do.
        env["TANDEM_ELASTIC_WORKER"] = str(job.rank)
    if job.rank != 0:
        env.pop("TANDEM_TERMINAL", None)  # only rank 0's bars redraw in place (launch.local.output)
    return env


def _end_child_with_agent(control: socket.socket, child: subprocess.Popen) -> None:
    """Kill the child's group when the agent is gone (end of file on the control socket).

    The agent closes the socket only after it read `exit`, or by dying; in the second case
    nobody is left to stop the rank or report on it, so it must not run on (nor hold the
    other ranks in a collective) under an mpiexec that does not notice.
    """
    try:
        while control.recv(256):
            pass
    except OSError:
        pass
    if child.returncode is None:
        signal_group(child.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connect", required=True, help="HOST:PORT of the agent")
    parser.add_argument("--store", required=True, help="HOST:PORT of the agent's rendezvous store")
    parser.add_argument("--torch-port", type=int, default=None,
                        help="MASTER_PORT for torchrun-style scripts (rank 0's TCPStore)")
    parser.add_argument("--run-id", default="", help="TORCHELASTIC_RUN_ID")
    parser.add_argument("--forker", action="store_true",
                        help="started by MPICH's gforker: ignore its SIGINT and SIGQUIT")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job = _mpi_job(os.environ)
    if args.forker:
        # The rest of the job is stopped by the agent, which reports who failed first; gforker
        # signals every supervisor by pid (the ranks run in sessions of their own). Handlers,
        # not SIG_IGN: the program does not inherit them.
        for signum in FORKER_KILLS:
            signal.signal(signum, lambda signum, frame: None)
        # gforker runs every rank on this node and, unlike Hydra, says nothing of local ranks
        # (MPI_LOCALRANKID): local and global are the same (the GPU each rank takes, for one).
        job = dataclasses.replace(job, local_rank=job.rank, local_size=job.size)
    token = settings.current().launch_token or ""
    address = parse_address(args.connect)
    try:
        streams = {kind: launch_port.connect(address, token, job.rank, kind, CONNECT_TIMEOUT_S)
                   for kind in launch_port.KINDS}
    except (OSError, AuthenticationFailed) as error:
        raise SystemExit(f"mpi_rank.py: rank {job.rank} cannot reach its tandem run agent at "
                         f"{args.connect}: {error}") from None
    # The job's environment, then what mpiexec set (PMI_FD, PMI_RANK...: os.environ holds
    # what mpiexec was given, a part of the job's, plus those).
    base = {**_receive_environment(streams["control"]), **os.environ}
    env = _child_environment(job, parse_address(args.store), base, args.torch_port, args.run_id)
    control = streams["control"]
    try:
        child = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=streams["stdout"].fileno(),
            stderr=streams["stderr"].fileno(), close_fds=False, start_new_session=True,
        )
    except OSError as error:  # the agent names the cause; nothing to stop
        why = error.strerror or str(error)
        try:
            control.sendall(f"error {start_failure_code(error)} {why}\n".encode())
        except OSError:
            pass  # the agent is gone: nobody to tell
        control.close()
        return 0
    streams["stdout"].close()  # the child holds them now: end of file when it is gone
    streams["stderr"].close()

    for signum in FORWARDED:
        if not (args.forker and signum in FORKER_KILLS):
            signal.signal(signum, lambda signum, frame: signal_group(child.pid, signum))
    # Hydra run with -disable-auto-cleanup tells the surviving processes that one failed with
    # SIGUSR1; stopping the job is the agent's decision, so the supervisor stays to report.
    # (A handler rather than SIG_IGN: handlers are not inherited by the program.)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        control.sendall(f"pid {child.pid}\n".encode())
    except OSError:
        pass  # the agent is gone: the watcher below ends the child
    threading.Thread(target=_end_child_with_agent, args=(control, child),
                     name="tandem-agent-watch", daemon=True).start()
    code = child.wait()
    try:
        control.sendall(f"exit {code}\n".encode())
    except OSError:
        pass
    control.close()
    return 0


if __name__ == "__main__":
    main()
    # No interpreter teardown: it would restore SIGUSR1's default action, and a late SIGUSR1
    # from Hydra would then kill us and make mpiexec print a failure banner for nothing.
    sys.stdout.flush()
    os._exit(0)
