"""Fault injection: does every failure end the job quickly, non-zero, naming the rank?

    python benchmarks/faults.py                      # 20 kills, 5 of each other fault, np 2 and 4
    python benchmarks/faults.py --trials 3 --other-trials 1 --worlds 2 --kinds kill,raise
    python benchmarks/faults.py --backend gloo       # the same on Gloo (default: tandem run's)
    python benchmarks/faults.py --overhead           # the price of the watchdog and debug mode
    python benchmarks/faults.py --kinds shard_skip_step,shard_state_dict,tp_skip_step,\
        pipe_skip_opt,pipe_skip_step --trials 1 --other-trials 2 --worlds 2   # split models

Each trial runs `tandem run -np W tests/scripts/fault_train.py KIND --at STEP --rank R` (a
small data-parallel job) with TANDEM_TIMEOUT=5, the rank and step drawn at random (seeded):

  kill        SIGKILL of the rank
  raise       an exception in the rank
  skip        the rank skips an all-reduce and enters a barrier   (with and without debug mode)
  skip_recv   the rank skips an all-reduce and waits in a receive (with and without debug mode)
  skip_step   the rank skips a whole step, the wrong way (`continue` on that rank only)
  skip_opt    the rank runs backward but skips the optimizer step
  diverge     the rank calls td.broadcast where the others step the optimizer
              (these three with and without debug mode: a DivergedError on every rank)

and on split models (`tests/scripts/fault_split.py`; with and without debug mode):

  shard_skip_step   fully_shard: the rank skips backward and step after its forward
  shard_state_dict  fully_shard: rank 0 alone calls td.fsdp.full_state_dict
  tp_skip_step      td.parallelize: the rank skips backward and step after its forward
  pipe_skip_opt     td.Pipeline: the rank's stage skips its optimizer step
  pipe_skip_step    td.Pipeline: the rank's stage skips a whole iteration (named at the end)

A trial passes when the job ends within `--bound` seconds (10) of the fault with a non-zero
code, the output names the rank as the contract says (the summary for kill/raise, the
mismatch error or the watchdog report for the skips), and no process it started outlives it.
The table gives, per kind and world size, passes, and the median and maximum time from the
fault to the end of the job; every trial goes to JSON (`results/faults.json`). The trials
themselves (running one, judging it) live in `tandem.bench.faults`, shared with the tests.

`--overhead` runs one 2-rank job that measures, in the same processes and interleaved so that
a busy machine slows every variant alike: a small `td.allreduce` (8 floats, the user path
with its argument check), the same all-reduce issued straight on the backend (the path the
data-parallel reducer takes) and a data-parallel training step (`td.DistributedOptimizer`, an
MLP 784-256-256-10, batch 64 per rank), each with the watchdog off (the bare engine), on (the
default) and with debug mode; raw `torch.distributed.all_reduce` is the PyTorch reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.faults import KINDS, job_environment, run_trial, trial_plan
from tandem.bench.results import write_json

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "scripts" / "fault_train.py"


def table(results: list[dict], bound: float) -> str:
    rows = [f"{'fault':<26}{'np':>3}{'passed':>9}{'median s':>10}{'max s':>8}   (bound {bound:g} s)"]
    keys = sorted({(r["kind"], r["debug"], r["world"]) for r in results},
                  key=lambda k: (KINDS.index(k[0]), k[1], k[2]))
    for kind, debug, world in keys:
        group = [r for r in results if (r["kind"], r["debug"], r["world"]) == (kind, debug, world)]
        times = [r["seconds_after_fault"] for r in group if r["seconds_after_fault"] is not None]
        passed = sum(r["ok"] and r["seconds_after_fault"] <= bound for r in group)
        label = kind + (" (debug)" if debug else "")
        median = f"{statistics.median(times):.2f}" if times else "-"
        worst = f"{max(times):.2f}" if times else "-"
        rows.append(f"{label:<26}{world:>3}{passed:>5}/{len(group):<3}{median:>10}{worst:>8}")
    return "\n".join(rows)


# --- the price of the safety nets (runs inside a 2-rank job) ---------------------------------

def _overhead_worker(out: str, reps: int, iters: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tandem as td
    from tandem import runtime

    td.init()
    state = runtime.state()
    watched = state.backend
    bare = getattr(watched, "inner", watched)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(td.rank())
    x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
    small = torch.ones(8)

    def user():
        td.allreduce(small, op="sum", inplace=True)

    def backend():
        runtime.get_backend().allreduce(small, "sum", None).wait(state.timeout)

    def raw():
        dist.all_reduce(small)

    def dp_step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    variants = {"off": (bare, False), "on": (watched, False), "debug": (watched, True)}
    loads = {"td.allreduce 8 floats": (user, iters), "backend allreduce 8 floats": (backend, iters),
             "DP step MLP": (dp_step, max(5, iters // 10))}
    times: dict = {(load, v): [] for load in loads for v in variants}
    times.update({("torch.distributed all_reduce", "raw"): []})
    for rep in range(reps):
        order = list(variants)
        order = order[rep % 3:] + order[: rep % 3]  # rotate: no variant always goes first
        for load, (fn, count) in loads.items():
            for variant in order:
                state.backend, state.debug = variants[variant]
                td.barrier()
                start = time.perf_counter()
                for _ in range(count):
                    fn()
                times[(load, variant)].append((time.perf_counter() - start) / count)
            state.backend, state.debug = watched, False
        td.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            raw()
        times[("torch.distributed all_reduce", "raw")].append((time.perf_counter() - start) / iters)
    state.backend, state.debug = watched, False
    if td.rank() == 0:
        summary = {f"{load} | {variant}": statistics.median(values) * 1e6
                   for (load, variant), values in times.items()}
        Path(out).write_text(json.dumps(summary))
    td.shutdown()


def cpu_costs(count: int = 20000) -> dict:
    """Per-operation CPU cost of the watchdog's bookkeeping and of a fingerprint, in µs.

    Measured in this process against an engine that completes at once, so that nothing but
    tandem's own Python is timed (the distributed numbers above are at the mercy of the load).
    """
    import torch

    from tandem.comm.agreement import fingerprints
    from tandem.comm.engines.backend import CompletedWork
    from tandem.comm.watchdog.monitor import Watchdog
    from tandem.comm.watchdog.watched import WatchedBackend

    class Instant:
        name, rank, size = "instant", 0, 2

        def allreduce(self, tensor, op, group):
            return CompletedWork()

    bare = Instant()
    watched = WatchedBackend(bare, Watchdog(0, 2, 300.0, False, None))
    tensor = torch.ones(8)

    def per_op(fn) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(count):
                fn()
            best = min(best, (time.perf_counter() - start) / count * 1e6)
        return best

    plain = per_op(lambda: bare.allreduce(tensor, "sum", None).wait(300.0))
    wrapped = per_op(lambda: watched.allreduce(tensor, "sum", None).wait(300.0))
    stamp = per_op(lambda: fingerprints.next_fingerprint("allreduce", "world"))
    fingerprints.reset()
    return {"engine call + wait": plain, "watched call + wait": wrapped,
            "watchdog per op": wrapped - plain, "debug fingerprint per collective": stamp}


def overhead(args) -> dict:
    scratch = Path(args.out).with_suffix(".overhead.tmp.json")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tandem", "run", "-np", "2", __file__, "--overhead-worker",
               str(scratch), "--reps", str(args.reps), "--iters", str(args.iters)]
    done = subprocess.run(command, cwd=ROOT, env=job_environment({}), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"the overhead job failed:\n{done.stderr[-3000:]}")
    measured = json.loads(scratch.read_text())
    scratch.unlink()
    rows = [f"{'workload':<30}{'off µs':>10}{'on µs':>10}{'debug µs':>10}{'on/off':>8}"
            f"{'debug/off':>10}"]
    for load in ("td.allreduce 8 floats", "backend allreduce 8 floats", "DP step MLP"):
        off, on, debug = (measured[f"{load} | {v}"] for v in ("off", "on", "debug"))
        rows.append(f"{load:<30}{off:>10.1f}{on:>10.1f}{debug:>10.1f}{on / off:>8.3f}"
                    f"{debug / off:>10.3f}")
    reference = measured["torch.distributed all_reduce | raw"]
    rows.append(f"{'torch.distributed all_reduce':<30}{reference:>10.1f}   (the PyTorch reference)")
    costs = cpu_costs()
    rows.append("CPU cost per operation, in one process (µs): " + ", ".join(
        f"{name} {value:.2f}" for name, value in costs.items()))
    print("\n".join(rows))
    measured.update({f"cpu | {name}": value for name, value in costs.items()})
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="SIGKILL trials per world size")
    parser.add_argument("--other-trials", type=int, default=5,
                        help="trials of each other fault per world size")
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"some of {', '.join(KINDS)}")
    parser.add_argument("--timeout", type=float, default=5.0, help="TANDEM_TIMEOUT of the jobs")
    parser.add_argument("--bound", type=float, default=10.0, help="seconds a job may take to end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None,
                        help="gloo or mpi (default: tandem run's, MPI on CPU when installed)")
    parser.add_argument("--overhead", action="store_true", help="measure the overhead instead")
    parser.add_argument("--overhead-worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=30, help="overhead: repetitions")
    parser.add_argument("--iters", type=int, default=100, help="overhead: all-reduces per block")
    parser.add_argument("--out", default="results/faults.json")
    args = parser.parse_args(argv)
    if args.overhead_worker:
        _overhead_worker(args.overhead_worker, args.reps, args.iters)
        return 0
    out = Path(args.out)
    if args.overhead:
        write_json(overhead(args), out.with_name(out.stem + "_overhead.json"))
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")
    plan = trial_plan(kinds, [int(w) for w in args.worlds.split(",")], args.trials,
                      args.other_trials, args.seed)
    results = []
    for number, trial in enumerate(plan, start=1):
        result = run_trial(TRAIN, timeout_s=args.timeout, backend=args.backend, cwd=ROOT, **trial)
        results.append(result)
        verdict = "ok" if result["ok"] and result["seconds_after_fault"] <= args.bound else "FAIL"
        seconds = result["seconds_after_fault"]
        print(f"[{number}/{len(plan)}] {trial['kind']}{' debug' if trial['debug'] else ''} "
              f"np={trial['world']} rank={trial['rank']} step={trial['step']}: {verdict} "
              f"({'-' if seconds is None else f'{seconds:.2f}'} s, exit {result['exit_code']})",
              flush=True)
    print(table(results, args.bound))
    write_json({"timeout_s": args.timeout, "bound_s": args.bound, "trials": results}, out)
    print(f"wrote {out}")
    failed = [r for r in results if not (r["ok"] and r["seconds_after_fault"] <= args.bound)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
