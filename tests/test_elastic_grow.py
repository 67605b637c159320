"""An elastic job that grows while its ranks are still setting up (`tandem run --min-np A --max-np B
--host-discovery-script`): a grow never breaks healthy ranks.

The launcher may form the round that adds a discovered worker while the first ranks are still in a
collective of their set-up (building `td.DistributedOptimizer`, before `td.elastic.run`). That
world is not over: every one of its workers is in the new round, so its ranks finish what they are
doing, see the new round at their first commit (`State.check_host_updates` -> `WorldChanged`), and
the new worker waits for them at the roll call (`elastic_rounds.publish` marks a round over only
when a later round leaves out one of its workers). Gloo only: an MPI world cannot grow.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "tests" / "scripts" / "elastic_train.py")
SCENARIO_S = 90  # the job (a grow 2 -> 3) and its one-process reference, each


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def test_a_worker_discovered_while_the_ranks_set_up_joins_at_their_first_commit(tmp_path):
    """The script offers 3 slots from the start of a -np 2 job; ranks 0 and 1 sit in a set-up
    td.broadcast (--grow-in-setup) until the launcher formed round 1 with the third worker, and
    for 2.5 s more (past their watchdog's next look at the board). Before, the watchdog aborted that
    broadcast ("allreduce #1 ... was abandoned: the elastic job's launcher formed its next round")
    and the job failed; now round 0 goes on, moves to round 1 at the first commit, and the job ends
    with the one-process parameters."""
    discovery = tmp_path / "slots.sh"
    discovery.write_text("#!/bin/sh\necho localhost:3\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    out, reference = tmp_path / "out.pt", tmp_path / "reference.pt"
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(discovery), TRAIN, str(out), "--grow-in-setup"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=SCENARIO_S)
    assert done.returncode == 0, done.stderr
    assert "tandem run: elastic: world 2 -> 3 (round 1): 1 worker(s) joined" in done.stderr
    assert "abandoned" not in done.stderr, done.stderr
    subprocess.run([sys.executable, TRAIN, str(reference)], cwd=ROOT, env=_env(), check=True,
                   timeout=SCENARIO_S)
    result, expected = torch.load(out), torch.load(reference)
    assert result["sizes"] == [2] + [3] * 11  # step 0 on round 0; its commit moved the job
    assert result["step"] == expected["step"] == 12
    for name, value in expected["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-5)
