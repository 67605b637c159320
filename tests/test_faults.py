"""Fault injection, a few trials: each fault ends the job, non-zero, naming the rank, no orphans.

The trials are the ones `benchmarks/faults.py` runs twenty times each at world sizes 2 and 4
(both use `tandem.bench.faults.run_trial`, so the test and the benchmark judge alike); here one
of each kind at world size 2, the rank and step drawn from a fixed seed, on Gloo and on MPI
(`tandem run`'s CPU default, whose ranks mpiexec starts). How fast each kind ends is
`benchmarks/faults.py`'s to measure (docs/failures.md has its table); here the report itself
says which mechanism ended the job (`faults.named`: in debug mode the fingerprints' report,
not the watchdog's timeout), and a job that took a minute would be a hang. Split models
(`fault_split.py`): a fully sharded model's rank that skips backward, and rank 0 calling
`td.full_state_dict` alone, end with a DivergedError on every rank.
"""

from __future__ import annotations

import importlib.util
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench import faults
from tandem.testing import still_running

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 60.0  # TANDEM_TIMEOUT=5: far beyond any report, however loaded the machine

TRAIN = ROOT / "tests" / "scripts" / "fault_train.py"

_random = random.Random(7)
CASES = [(kind, debug, _random.randrange(1, 6))
         for kind, debug in [("kill", False), ("skip", False), ("skip", True),
                             ("skip_recv", True),  # an exception: test_launcher.py
                             ("shard_skip_step", False), ("shard_state_dict", False)]]
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")


def _marks(backend: str) -> list:
    return [] if backend == "gloo" else [needs_mpi]


TRIALS = [pytest.param(backend, kind, debug, step, marks=_marks(backend),
                       id=f"{backend}-{kind}{'-debug' if debug else ''}")
          for backend in ("gloo", "mpi") for kind, debug, step in CASES]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend, kind, debug, step", TRIALS)
def test_a_fault_ends_the_job_fast_naming_the_rank(backend, kind, debug, step):
    rank = 0 if kind == "shard_state_dict" else 1  # the habitual "save on rank 0"
    result = faults.run_trial(TRAIN, kind, world=2, rank=rank, step=step, debug=debug,
                              timeout_s=5.0, steps=30, backend=backend, cwd=ROOT)
    assert result["all_ranks_started"], result
    assert result["exit_code"] != 0, result
    assert result["named"], result.get("stderr_tail")
    assert not result["orphans"], f"processes outlived the job: {result['orphans']}"
    print(f"{kind} debug={debug}: ended {result['seconds_after_fault']:.2f} s after the fault")
    assert result["seconds_after_fault"] < HANG_S, result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=needs_mpi)])
def test_ranks_do_not_outlive_a_killed_agent(backend):
    """SIGKILL to `tandem run` itself: its ranks notice and end within seconds (on Gloo their
    watchdog sees the agent gone; on MPI their supervisor sees its connection to it close)."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", backend,
         str(TRAIN), "ok", "--steps", "500", "--step-seconds", "0.05"],
        cwd=ROOT, env=faults.job_environment({}), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )
    seen = []
    try:
        for line in agent.stdout:
            seen.append(line)
            if line.startswith("[0] step 3 "):
                break
        agent.send_signal(signal.SIGKILL)  # no chance to stop its ranks
        agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
    pids = [int(p) for p in re.findall(r"^\[\d\] pid=(\d+) ", "".join(seen), re.MULTILINE)]
    assert len(pids) == 2, seen
    assert still_running(pids, timeout=10.0) == [], "ranks outlived their killed agent"
