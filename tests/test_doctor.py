"""`tandem doctor`: one line per check, a fix when something is missing, always exit 0."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import doctor

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_doctor_prints_every_check_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run([sys.executable, "-m", "tandem", "doctor"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == ["tandem", "Gloo", "NCCL", "MPI", "CUDA", "cores", "network", "ports", "shm"]
    by_name = dict(zip(names, lines, strict=True))
    assert "torch " in by_name["tandem"] and "python " in by_name["tandem"]
    assert by_name["Gloo"].split(None, 1)[1].startswith("available")
    assert f"{len(os.sched_getaffinity(0))} usable" in by_name["cores"]
    # Every interface, as "name (state)", the state read from /sys; a fix only when no
    # interface but loopback is up.
    states = {}
    for _, name in socket.if_nameindex():
        try:
            states[name] = Path(f"/sys/class/net/{name}/operstate").read_text().strip()
        except OSError:
            states[name] = "?"
    detail = by_name["network"].split(None, 1)[1]
    listed, _, fix = detail.partition(" -- fix: ")
    assert dict(re.findall(r"(\S+) \(([^)]*)\)", listed)) == states, detail
    assert "lo" in states
    nic_up = any(state in ("up", "unknown") for name, state in states.items() if name != "lo")
    assert bool(fix) == (not nic_up), detail
    if importlib.util.find_spec("mpi4py") is not None:
        assert "available: " in by_name["MPI"] and "mpi4py" in by_name["MPI"]


def test_missing_mpi4py_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpi4py" else real(name, *a))
    check = doctor.check_mpi()
    assert not check.ok
    assert "pip install mpi4py mpich" in check.line()


def test_busy_port_is_reported():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        check = doctor.check_ports((port,))
    assert not check.ok and str(port) in check.detail and "MASTER_PORT" in check.fix


def test_a_broken_check_becomes_a_line(monkeypatch):
    def broken() -> doctor.Check:
        raise OSError("no /sys here")

    monkeypatch.setattr(doctor, "CHECKS", (broken, doctor.check_cores))
    lines = [check.line() for check in doctor.run_checks()]
    assert lines[0].startswith("broken") and "OSError: no /sys here" in lines[0]
    assert lines[1].startswith("cores")
