"""`import tandem` loads no torch: the `tandem` command starts without it (DESIGN section 10).

Each check runs in a fresh interpreter and looks at `sys.modules` afterwards. `tandem doctor`
is exempt in part: its Gloo, NCCL and CUDA lines are torch's answers, so those three checks
import torch inside themselves; every other line, and the command around them, needs none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_CHECKS = ("check_gloo", "check_nccl", "check_cuda")  # doctor's torch questions


def _without_torch(code: str) -> subprocess.CompletedProcess:
    """Run `code`, then fail (exit 3) if torch was imported; stdout says what was loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    guard = ("\nimport sys\nif 'torch' in sys.modules:\n    print('torch was imported')\n"
             "    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code + guard], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _main(*argv: str) -> str:
    return f"from tandem.cli.command import main\ncode = main({list(argv)!r})\n"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"],
                                  ["scale", "--help"], ["--version"]],
                         ids=lambda argv: " ".join(argv))
def test_the_command_starts_without_torch(argv):
    done = _without_torch(_main(*argv))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_and_the_launcher_import_no_torch():
    done = _without_torch(
        "import tandem, tandem.launch, tandem.launch.mpi.rank, tandem.job.settings\n"
        "from tandem.launch.agents import coordinator, multinode; from tandem.launch.local import "
        "supervisor\n"
        "assert 'init' in dir(tandem) and 'broadcast_buffers' in tandem.__all__\n"
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_tandem_run_decides_and_checks_the_job_without_torch(tmp_path):
    """The parent of `tandem run` parses, picks the backend and checks the program without
    torch."""
    code = (
        "from tandem.launch import LaunchConfig, launcher\n"
        "config = launcher.with_backend(LaunchConfig(np=2, program='t.py'))\n"
        "assert config.backend in ('gloo', 'mpi', 'nccl')\n"
        + _main("run", "-np", "2", str(tmp_path / "missing.py"))
        + "assert code == 2, code\n"
    )
    done = _without_torch(code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "does not exist" in done.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_tandem_runs_a_whole_job_without_torch_in_its_parent(tmp_path, backend):
    """The rendezvous store that `tandem run` hosts is plain Python: only the ranks load torch."""
    if backend == "mpi":
        pytest.importorskip("mpi4py", reason="the MPI launcher needs mpi4py")
    script = tmp_path / "job.py"
    script.write_text("import sys\nimport tandem as td\ntd.init()\ntd.barrier()\n"
                      "print('rank', td.rank(), 'torch' in sys.modules)\ntd.shutdown()\n")
    done = _without_torch(_main("run", "-np", "2", "--backend", backend, str(script))
                          + "assert code == 0, code\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0] rank 0 True" in done.stdout and "[1] rank 1 True" in done.stdout, done.stdout


def test_doctor_imports_torch_only_for_torchs_own_lines():
    code = (
        "from tandem.cli import doctor\n"
        f"doctor.CHECKS = tuple(c for c in doctor.CHECKS if c.__name__ not in {TORCH_CHECKS!r})\n"
        + _main("doctor") + "assert code == 0\n"
    )
    done = _without_torch(code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cores" in done.stdout and "MPI" in done.stdout


def test_public_names_resolve_on_first_use():
    import tandem

    assert set(tandem.__all__) <= set(dir(tandem))
    for name in tandem.__all__:
        assert getattr(tandem, name) is not None, name
    from tandem import broadcast_buffers  # noqa: F401
    from tandem.errors import ReplicaBufferWarning  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tandem.no_such_name  # noqa: B018
