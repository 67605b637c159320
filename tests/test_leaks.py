"""Nothing left behind, nothing exposed: MPI's /dev/shm segments of a failed `tandem run` job
are removed, `tandem doctor` names stale ones with the command that clears them, and a local
MPI job's ranks listen on loopback only."""

import importlib.util
import mmap
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.launch.mpi import shm

SCRIPTS = Path(__file__).parent / "scripts"


def test_stale_segments_are_named_with_the_command_and_mapped_ones_are_not(tmp_path):
    stale = tmp_path / "mpich_shm_deadbeef_0"
    stale.write_bytes(b"\0" * 4096)
    (tmp_path / "not_mpi").write_bytes(b"x")
    what, command = shm.describe_stale(tmp_path)
    assert "1 stale MPI segment(s)" in what and "mpich_shm_deadbeef_0" in what
    assert command == ("tandem doctor --clean (removes only the segments no process uses), "
                       f"or rm -f {stale}")
    with open(stale, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        assert shm.describe_stale(tmp_path) is None  # a live job maps it: not stale
    assert shm.remove_new(set(), tmp_path) == ["mpich_shm_deadbeef_0"] and not stale.exists()
    assert (tmp_path / "not_mpi").exists()


needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="no mpi4py")


def _tandem_run_mpi(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-m", "tandem", "run", "--backend", "mpi", "-np", "2",
                           str(SCRIPTS / script)], env=env, capture_output=True, text=True,
                          timeout=100)


@pytest.mark.timeout(120)
@needs_mpi
@pytest.mark.skipif(shutil.which("ss") is None, reason="no ss")
def test_a_local_mpi_jobs_ranks_listen_on_loopback_only():
    done = _tandem_run_mpi("mpi_listeners.py")
    assert done.returncode == 0, done.stderr
    said = re.findall(r"^\[\d\] rank \d listens on (\d+) socket\(s\); outside loopback: (.*); mpiexec's",
                      done.stdout, re.M)
    assert len(said) == 2, done.stdout
    assert all(outside == "none" for _, outside in said), said


@pytest.mark.timeout(120)
@needs_mpi
def test_a_failed_mpi_job_leaves_no_shared_memory():
    done = _tandem_run_mpi("mpi_shm_fail.py")
    assert done.returncode == 1 and "rank 1 fails after td.init()" in done.stderr, done.stderr
    mapped = set()
    for line in re.findall(r"^\[\d\] rank \d maps (.*)$", done.stdout, re.M):
        mapped |= {name for name in line.split() if not name.startswith("(")}
    segments = {name for name in mapped if name.startswith(("mpich_shm_", "sm_segment", "vader"))}
    assert segments, done.stdout  # the ranks did use shared memory that outlived MPI's init
    left = [name for name in segments if (shm.SHM_DIR / name).exists()]
    assert not left, f"left in /dev/shm: {left}"
