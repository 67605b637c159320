"""Group creation is agreed and watched: ranks that create different groups are named, never hung.

`td.new_group` and `td.mesh` are collective over the whole world on every engine; torch's own
`dist.new_group` waits, outside any watchdog, for ranks that create another group. The ranks
first agree on the call (one standard agreement message), so each mistake below is one error on
every rank within seconds, on Gloo and MPI, with each rank's call and the fix; the world stays
usable afterwards. A rank that never comes is the watchdog's (its timeout), run as a user would
through `tandem run`.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem as td
from tandem.comm.groups import GroupMismatchError
from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
BACKENDS = ["gloo", pytest.param("mpi", marks=needs_mpi)]


def _caught(make) -> tuple[str, str]:
    try:
        make()
    except td.CollectiveMismatchError as error:
        return type(error).__name__, str(error)
    raise AssertionError("the mismatch was not caught")


def check_different_groups():
    rank = td.rank()
    found = {
        # The user trial's mistake: each rank builds its own idea of the mesh.
        "meshes": _caught(lambda: td.mesh(dp=2) if rank == 0 else td.mesh(tp=2)),
        # Sizes that do not fit the world on one rank only: named as the odd one out, not a
        # ValueError on that rank alone (which would leave the other waiting for it).
        "sizes": _caught(lambda: td.mesh(dp=2) if rank == 0 else td.mesh(dp=4)),
        "ranks": _caught(lambda: td.new_group([0, 1] if rank == 0 else [1, 0])),
        "kinds": _caught(lambda: td.new_group([0]) if rank == 0 else td.mesh(pp=2)),
        # One rank skipped the group and went on to a barrier: different operations.
        "skipped": _caught(lambda: td.new_group([0, 1]) if rank == 0 else td.barrier()),
    }
    # Nothing was half-created: the world still works, and so does a group made together.
    group = td.new_group([1, 0])
    total = td.allreduce(torch.tensor([float(rank + 1)]), op="sum", group=group).item()
    layout = td.mesh(dp=1, tp=2)
    return found, total, list(layout.tp_group.ranks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_create_different_groups_are_named(backend):
    results = run_distributed(check_different_groups, world_size=2, backend=backend)
    assert results[0] == results[1]  # every rank raises the same errors, and goes on
    found, total, tp_ranks = results[0]
    assert (total, tp_ranks) == (3.0, [0, 1])
    for name in ("meshes", "sizes", "ranks", "kinds"):
        kind, message = found[name]
        assert kind == GroupMismatchError.__name__, (name, message)
        assert "td.new_group / td.mesh: the ranks created different groups" in message
        assert "Every rank must make the same td.new_group / td.mesh calls" in message
    assert "rank 0: td.mesh(dp=2, pp=1, tp=1) at test_groups.py:" in found["meshes"][1]
    assert "rank 1: td.mesh(dp=1, pp=1, tp=2) at test_groups.py:" in found["meshes"][1]
    assert "rank 1: td.mesh(dp=4, pp=1, tp=1)" in found["sizes"][1]
    assert "rank 0: td.new_group([0, 1])" in found["ranks"][1]
    assert "rank 1: td.new_group([1, 0])" in found["ranks"][1]
    assert "rank 0: td.new_group([0])" in found["kinds"][1]
    assert "rank 1: td.mesh(dp=1, pp=2, tp=1)" in found["kinds"][1]
    kind, message = found["skipped"]
    assert kind == "DivergedError", message
    assert "rank 0: td.new_group([0, 1])" in message and "rank 1: barrier()" in message


def check_bad_ranks_after_agreement():
    errors = []
    for bad in ([0, 0], [0, 5], ["0", "1"], None):
        try:
            td.new_group(bad)
        except (ValueError, TypeError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def test_bad_ranks_are_the_same_error_on_every_rank():
    results = run_distributed(check_bad_ranks_after_agreement, world_size=2)
    assert results[0] == results[1]
    assert results[0][0] == "ValueError: new_group got a rank twice: [0, 0]"
    assert results[0][1] == "ValueError: ranks [5] are outside the world of size 2"
    assert results[0][2].startswith("TypeError: td.new_group(['0', '1']): ranks must be a")
    assert results[0][3].startswith("TypeError: td.new_group(None): ranks must be a")


def _tandem_run(*args: str, timeout_s: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TANDEM_TIMEOUT"] = timeout_s
    return subprocess.run([sys.executable, "-m", "tandem", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend, call", [("gloo", "mesh"),
                                           pytest.param("mpi", "new_group", marks=needs_mpi)])
def test_a_rank_that_never_creates_the_group_is_named_by_the_watchdog(backend, call):
    result = _tandem_run("-np", "2", "--backend", backend,
                         str(ROOT / "tests" / "scripts" / "group_skip.py"), call, timeout_s="3")
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert "WatchdogTimeout" in err, err[-3000:]
    assert "arrived:     rank 0" in err and "not arrived: rank 1" in err
    assert f"called as td.{call} at group_skip.py:" in err
    assert f"the argument check of td.{call}" in err
    assert "threading.Event().wait()" in err  # rank 1's own stack, fetched from rank 1
    assert "not reached" not in result.stdout
