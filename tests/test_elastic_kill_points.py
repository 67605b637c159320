"""td.elastic.State(..., peer_backup=True) over sharded state (td.ZeroOptimizer's, td.fully_shard's)
when ranks are SIGKILLed at points of the step (issue 40, item 2): the survivors restore from
memory, no file, and end with the one-process result.

Each case is one `tandem run -np 3 --min-np 2` job of `tests/scripts/elastic_kill_points.py`
(Adam, 12 steps of 12 rows); the point of the step and the step itself are drawn from a fixed
seed, so the cases are reproducible and cover forward, backward, inside optimizer.step, inside
the commit (after the backup exchange) and between steps over the two ways of sharding. Then
two ranks that are not next to each other (1 and 3 of 4) die in one step: each one's part is
held by the next rank, which survives. These jobs run on Gloo; the same script under an
MPI world that shrinks (Open MPI with ULFM) is tests/test_mpi_elastic.py's.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "elastic_kill_points.py")
JOB_S = 120  # one job, start to end, on a loaded machine

_draw = random.Random(40)  # the kill steps: reproducible, not all alike
CASES = [(sharding, point, _draw.randint(2, 9)) for sharding, point in (
    ("--zero", "forward"), ("--zero", "step"), ("--zero", "commit"),
    ("--fsdp", "backward"), ("--fsdp", "between"), ("--fsdp", "commit"))]
TWO_LOST_STEP = _draw.randint(2, 9)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "adam.pt"
    subprocess.run([sys.executable, SCRIPT, str(out)], cwd=ROOT, env=_env(), check=True,
                   timeout=JOB_S)
    return torch.load(out)


def _job(out: Path, np: int, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """The job's result, and the commit it resumed from (the launcher's line)."""
    done = subprocess.run([sys.executable, "-m", "tandem", "run", "-np", str(np), "--min-np", "2",
                           "--max-np", str(np), SCRIPT, str(out), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=JOB_S)
    assert done.returncode == 0, done.stderr
    resumed = re.findall(r"resumed from commit (\d+) \(step \1\)", done.stderr)
    assert len(resumed) == 1 and "checkpoint" not in done.stderr, done.stderr
    return done, int(resumed[0])


def _same_as_one_process(out: Path, sizes: tuple[int, int], resumed: int, reference: dict) -> None:
    result = torch.load(out)
    assert result["sizes"] == [sizes[0]] * resumed + [sizes[1]] * (12 - resumed)
    assert result["step"] == reference["step"] == 12
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharding, point, step", CASES)
def test_a_rank_killed_at_a_point_of_the_step_is_restored_from_memory(
        tmp_path, one_process, sharding, point, step):
    out = tmp_path / "out.pt"
    done, resumed = _job(out, 3, sharding, "--kill", f"1:{step}:{point}")
    assert re.search(r"world 3 -> 2 \(round 1\): rank 1 \(worker 1\) (exit code|killed)",
                     done.stderr), done.stderr
    # a kill inside the step loses that step (the last commit is the one before it); a kill
    # inside the commit, after the backup exchange, leaves the others on that commit or the
    # one before (whichever every survivor reached)
    assert resumed in ((step, step + 1) if point == "commit" else (step,)), done.stderr
    _same_as_one_process(out, (3, 2), resumed, one_process)


@pytest.mark.parametrize("sharding", ["--zero", "--fsdp"])
def test_two_ranks_not_next_to_each_other_lost_at_4_are_restored_from_memory(
        tmp_path, one_process, sharding):
    step = TWO_LOST_STEP
    out = tmp_path / "out.pt"
    _, resumed = _job(out, 4, sharding, "--kill", f"1:{step}:forward,3:{step}:forward")
    assert resumed == step
    _same_as_one_process(out, (4, 2), resumed, one_process)
