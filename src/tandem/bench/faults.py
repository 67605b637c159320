"""Fault-injection trials: start a job with one faulty rank, then judge how it ended.

Shared by `benchmarks/faults.py` (many trials, a table, JSON) and `tests/test_faults.py` (one of
each kind), so the two judge alike. `script` is a small training job (the repository's
`tests/scripts/fault_train.py`) run as `tandem run -np W script KIND --at STEP --rank R` that
prints `[r] pid=P ...` when a rank starts and `[r] failing at T` (wall time) when it injects:

  kill        SIGKILL of the rank
  raise       an exception in the rank
  skip        the rank skips an all-reduce and enters a barrier
  skip_recv   the rank skips an all-reduce and waits in a receive
  skip_step   the rank skips a whole step (forward, backward, optimizer, the loss all-reduce)
  skip_opt    the rank runs backward but skips the optimizer step
  diverge     the rank calls td.broadcast where the others step the optimizer

and, on split models (`tests/scripts/fault_split.py`, next to `script`):

  shard_skip_step   fully_shard: the rank skips backward and step after its forward
  shard_state_dict  fully_shard: rank 0 alone calls td.fsdp.full_state_dict (the habitual save)
  tp_skip_step      td.parallelize: the rank skips backward and step after its forward
  pipe_skip_opt     td.Pipeline: the rank's stage skips its optimizer step (a NaN guard that
                    only the stage holding the loss runs)
  pipe_skip_step    td.Pipeline: the rank's stage skips a whole iteration (named at the end)

A trial is "ok" when the job ends non-zero, every rank had started, the output names the faulty
rank as the contract says (the summary for kill/raise, the mismatch error or the watchdog
report for the skips: `named`), and no process it started outlives it; `seconds_after_fault`
is the time from the fault to the end of the job, for the caller to hold against its bound.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from tandem.testing import still_running

#: The folder this tandem is imported from (src/ in a checkout), put first on the job's path.
SOURCE = Path(__file__).resolve().parents[2]
#: Faults of split models: kind -> (mode, layout) of `fault_split.py`.
SPLIT = {"shard_skip_step": ("skip_step", "shard"), "shard_state_dict": ("state_dict", "shard"),
         "tp_skip_step": ("skip_step", "tp"), "pipe_skip_opt": ("skip_opt", "pipe"),
         "pipe_skip_step": ("skip_step", "pipe")}
KINDS = ("kill", "raise", "skip", "skip_recv", "skip_step", "skip_opt", "diverge", *SPLIT)
#: Faults of code paths, run with and without debug mode.
PATHS = ("skip", "skip_recv", "skip_step", "skip_opt", "diverge", *SPLIT)
#: A rank that leaves the job first, one step ahead of the others, named at the end.
_LEFT = r"rank {rank} finished, but not every rank|rank {rank} has left the job|rank {rank}: left the job"


def job_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without `TANDEM_*` settings, plus `extra`; the job imports
    the same tandem as this process (its source folder first on PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def named(kind: str, rank: int, debug: bool, err: str) -> bool:
    """Whether the job's output names the faulty rank the way the contract promises."""
    patterns = {
        "kill": rf"job failed: rank {rank} \(pid \d+\) killed by SIGKILL",
        "raise": rf"job failed: rank {rank} \(pid \d+\) exit code 1",
        "skip": (rf"rank {rank}: #\d+ barrier\(\) at" if debug
                 else rf"rank {rank}\b[^\n]*barrier"),
        "skip_recv": (rf"rank {rank}: recv #1 from rank 0" if debug
                      else rf"rank {rank}\b[^\n]*recv #1 from rank 0"),
        # A DivergedError on every rank, naming each rank's operation (the faulty rank's here).
        # DistributedOptimizer sees no forward: a rank that skipped a whole step is one step
        # ahead until the end, where it finishes first and leaves while its peers still wait
        # (named by the watchdog, or by MPI's exit guard), unless an operation differs earlier.
        "skip_step": rf"  rank {rank}: gradient reduction #|" + _LEFT.format(rank=rank),
        "skip_opt": rf"  rank {rank}: gradient reduction #\d+ of DistributedOptimizer \(after \d+ "
                    "optimizer steps",
        "diverge": rf"  rank {rank}: (#\d+ )?broadcast\(",
        # Split models: every rank's DivergedError names the faulty rank's operation.
        "shard_skip_step": rf"  rank {rank}: fully_shard forward #\d+ of Sequential",
        "shard_state_dict": rf"  rank {rank}: state_dict #1 of Sequential(.|\n)*every rank "
                            "calls it",
        "tp_skip_step": rf"  rank {rank}: tensor-parallel forward #\d+ of Sequential",
        "pipe_skip_opt": rf"  rank {rank}: Pipeline train_step #\d+ of Sequential, stage {rank} "
                         r"\(after \d+ optimizer steps\)",
        "pipe_skip_step": _LEFT.format(rank=rank),
    }
    diverged = ("skip_opt", "diverge", *SPLIT)
    if kind in diverged and kind != "pipe_skip_step" and "DivergedError" not in err:
        return False
    return re.search(patterns[kind], err) is not None




def run_trial(script: Path, kind: str, world: int, rank: int, step: int, debug: bool,
              timeout_s: float = 5.0, steps: int = 40, backend: str | None = None,
              cwd: Path | None = None) -> dict:
    """One faulty job of `script` (on `tandem run`'s default backend unless `backend` names
    one); returns what happened, with the verdict in "ok" (see the module docstring)."""
    env = job_environment({"TANDEM_TIMEOUT": f"{timeout_s:g}", **({"TANDEM_DEBUG": "1"} if debug else {})})
    mode, extra = kind, []
    if kind in SPLIT:
        mode, layout = SPLIT[kind]
        script, extra = script.with_name("fault_split.py"), ["--layout", layout]
    command = [sys.executable, "-m", "tandem", "run", "-np", str(world),
               *(["--backend", backend] if backend else []), str(script), mode, *extra,
               "--steps", str(steps), "--at", str(step), "--rank", str(rank)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)
    ended = time.time()
    failed_at = re.search(rf"^\[{rank}\] failing at ([\d.]+)$", done.stdout, re.MULTILINE)
    pids = [int(p) for p in re.findall(r"^\[\d+\] pid=(\d+) ", done.stdout, re.MULTILINE)]
    elapsed = ended - float(failed_at.group(1)) if failed_at else None
    orphans = still_running(pids, timeout=5.0)
    result = {
        "kind": kind, "world": world, "rank": rank, "step": step, "debug": debug,
        "exit_code": done.returncode, "seconds_after_fault": elapsed,
        "named": named(kind, rank, debug, done.stderr), "orphans": orphans,
        "all_ranks_started": len(pids) == world,
    }
    result["ok"] = bool(done.returncode != 0 and elapsed is not None and result["named"]
                        and not orphans and len(pids) == world)
    if not result["ok"]:
        result["stderr_tail"] = done.stderr[-3000:]
    return result


def trial_plan(kinds, worlds, trials: int, other_trials: int, seed: int) -> list[dict]:
    """`trials` SIGKILLs and `other_trials` of every other fault, per world size (the state
    dict saved by one rank: by rank 0, the habit)."""
    rng = random.Random(seed)
    plan = []
    for world in worlds:
        for kind in kinds:
            for debug in ((False, True) if kind in PATHS else (False,)):
                for _ in range(trials if kind == "kill" else other_trials):
                    rank = rng.randrange(1, world)
                    plan.append({"kind": kind, "world": world, "debug": debug,
                                 "rank": 0 if kind == "shard_state_dict" else rank,
                                 "step": rng.randrange(1, 8)})
    return plan
