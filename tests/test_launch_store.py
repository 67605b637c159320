"""torch.distributed scripts under `tandem run`: rank 0's torch store listens on MASTER_ADDR
only, every rank that joined is seen joining (whatever its port), and a taken port is named
with the fix.

Real jobs (`python -m tandem run`) of tests/scripts/torch_store_probe.py, whose rank 0 tries to
reach its own store's port at an address of this machine that is not loopback.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from jobs_ahead import Ahead, Command

from tandem.launch.local.supervisor import port_taken

ROOT = Path(__file__).resolve().parents[1]
PROBE = str(ROOT / "tests" / "scripts" / "torch_store_probe.py")
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
JOB_TIMEOUT_S = 150


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TANDEM_TIMEOUT"] = "60"
    env.update(extra)
    return env


def tandem_run(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT,
                          env=_env(**extra), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


def _outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None."""
    if shutil.which("ip"):
        shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                               text=True, timeout=30).stdout
        for line in shown.splitlines():
            fields = line.split()
            if "inet" in fields:
                address = fields[fields.index("inet") + 1].split("/")[0]
                if not ipaddress.ip_address(address).is_loopback:
                    return address
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.fixture(scope="module")
def outside() -> str:
    address = _outside_address()
    if address is None:
        pytest.skip("this machine has no address besides loopback to probe the store from")
    return address


def _probe_line(done: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in done.stdout.splitlines() if line.startswith("[0] PROBE ")]
    assert len(lines) == 1, done.stdout + done.stderr
    return lines[0].split()[2:]  # sum, port, reached


# --- without jobs ---------------------------------------------------------------------------

def test_a_taken_port_in_a_ranks_last_lines_is_named_with_the_fix():
    torch_says = ("torch.distributed.DistNetworkError: The server socket has failed to listen on "
                  "any local network address. port: 29500, useIpv6: false, code: -98, name: "
                  "EADDRINUSE, message: address already in use")
    line = port_taken(0, ("Traceback (most recent call last):", torch_says))
    assert "rank 0 could not listen on port 29500" in line
    assert "remove that line" in line and "MASTER_PORT" in line
    python_says = "OSError: [Errno 98] Address already in use"
    assert "a port it asked for" in port_taken(1, (python_says,))
    assert port_taken(0, ("RuntimeError: something else",)) is None


# --- jobs -----------------------------------------------------------------------------------

# These jobs run side by side, ahead of their tests (tests/jobs_ahead.py); the taken port's
# job below holds its port through the job, so it runs in its test.
ahead = Ahead()
jobs = ahead.fixture()


def _tandem_run(*args: str, **extra: str) -> Command:
    return Command([sys.executable, "-m", "tandem", "run", *args], _env(**extra), ROOT,
                   JOB_TIMEOUT_S)


@ahead.plan("test_a_one_node_jobs_torch_store_is_on_loopback_only_and_the_ranks_join")
def _(tmp, backend, launch):
    address = _outside_address()
    if address is None or (launch == "mpi" and not HAVE_MPI):
        return []
    return [_tandem_run("-np", "2", "--backend", launch, "--require-join", PROBE, backend, address)]


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("backend, launch", [("gloo", "gloo"), ("tandem", "gloo"),
                                             ("mpi", "mpi"), ("gloo", "mpi")])
def test_a_one_node_jobs_torch_store_is_on_loopback_only_and_the_ranks_join(backend, launch,
                                                                             outside, jobs,
                                                                             request):
    """The store is unreachable from outside; the script works; --require-join sees it join
    (a fast script's ranks once went unseen, the port was watched then). `launch`: the
    launcher's --backend, which starts the ranks itself (gloo) or through mpiexec (mpi)."""
    if launch == "mpi" and not HAVE_MPI:
        pytest.skip("the MPI launch needs mpi4py")
    [done], _ = jobs.take(request.node)
    assert outside in done.args, (outside, done.args)
    assert done.returncode == 0, done.stdout + done.stderr
    total, _, reached = _probe_line(done)
    assert total == "3"  # 1 + 2: the all-reduce ran over both ranks
    assert reached == "False", f"rank 0's store answered at {outside}: {done.stdout}"
    assert "independent copies" not in done.stderr


@ahead.plan("test_a_script_with_its_own_master_port_is_seen_joining")
def _(tmp):
    address = _outside_address()
    if address is None:
        return []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp / "port").write_text(str(port))
    return [_tandem_run("-np", "2", PROBE, "gloo", address, HARD_PORT=str(port))]


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_script_with_its_own_master_port_is_seen_joining(outside, jobs, request):
    """MASTER_PORT set by the script: no false 'independent copies' warning (the port tandem
    run gave was watched once), and rank 0's store is still on loopback only."""
    [done], tmp = jobs.take(request.node)
    port = (tmp / "port").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert _probe_line(done) == ["3", port, "False"], done.stdout
    assert "independent copies" not in done.stderr, done.stderr


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_taken_master_port_is_named_with_the_fix():
    """The script's MASTER_PORT held by another program (a second job on the same hard-coded
    port): the summary names the port and what to do, not only torch's EADDRINUSE."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        taken = tandem_run("-np", "2", PROBE, "gloo", HARD_PORT=str(port))
    assert taken.returncode == 1, taken.stdout + taken.stderr
    assert f"tandem run: rank 0 could not listen on port {port}" in taken.stderr, taken.stderr
    assert "If the script sets MASTER_PORT itself, remove that line" in taken.stderr
