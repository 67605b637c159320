"""Does `tandem scale` put a step's time where it belongs? A communication-bound job and a
compute-bound one, two ranks each, and the share of a step each spends communicating.

    python benchmarks/comm_vs_compute.py                 # 3 repetitions, results/comm_vs_compute.json
    python benchmarks/comm_vs_compute.py --reps 5 --steps 8 --out /tmp/cvc.json

Both jobs run `tests/scripts/scale_train.py` through `tandem scale` (the same launcher as
`tandem run`), with 2 ranks on this machine:

* communication-bound: 64 small layers, every gradient in its own message (130 per step),
  one sample per rank, on Gloo. On one machine a big model alone does not do it (loopback
  moves bytes about as fast as the optimizer touches them); per-message latency does, and
  Gloo's (~0.4 ms a message on the 2-core test machine) is ~40x MPI's, so this job names Gloo.
* compute-bound: 76k parameters in one message, 4096 samples per rank (the default backend).

The expectation is that communication is most of the first job's step and little of the
second's. It is a claim about timings, so it lives here and not in the unit tests (which
must not fail because a shared machine was busy): each repetition runs both jobs, and the
table gives the communication share (comm_s / step_s) per repetition and its median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tandem.bench import scaling

SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "scripts" / "scale_train.py")
JOBS = {
    "communication-bound": dict(backend="gloo", args=(
        "--hidden", "64", "--layers", "64", "--bucket-mb", "0.001", "--batch", "2",
        "--samples", "64", "--report")),
    "compute-bound": dict(backend=None, args=(
        "--hidden", "256", "--batch", "8192", "--samples", "16384", "--report")),
}


def measure(job: str, steps: int, warmup: int, folder: str) -> dict:
    config = scaling.ScaleConfig(nps=(2,), program=SCRIPT, steps=steps, warmup=warmup,
                                 out=str(Path(folder) / job), **JOBS[job])
    row = scaling.run(config, echo=lambda *_: None)["rows"][0]
    return {key: row[key] for key in ("step_s", "comm_s", "compute_s", "data_s", "global_batch")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of both jobs (3)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per job (4)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (2)")
    parser.add_argument("--out", default="results/comm_vs_compute.json")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {job: [] for job in JOBS}
    with tempfile.TemporaryDirectory(prefix="tandem-cvc-") as folder:
        for rep in range(args.reps):
            for job in JOBS:  # alternate, so that a load that drifts hits both jobs alike
                runs[job].append(measure(job, args.steps, args.warmup, f"{folder}/{rep}"))

    print(f"2 ranks, {args.steps} measured steps, {args.reps} repetitions; "
          "communication share = comm_s / step_s")
    print(f"{'job':<22}{'step (ms)':>11}{'comm (ms)':>11}{'compute (ms)':>14}{'comm share':>12}")
    summary = {}
    for job, rows in runs.items():
        shares = [row["comm_s"] / row["step_s"] for row in rows]
        summary[job] = {"median_comm_share": statistics.median(shares), "comm_shares": shares}
        for row, share in zip(rows, shares, strict=True):
            print(f"{job:<22}{row['step_s'] * 1e3:>11.2f}{row['comm_s'] * 1e3:>11.2f}"
                  f"{row['compute_s'] * 1e3:>14.2f}{share:>12.2f}")
    comm = summary["communication-bound"]["median_comm_share"]
    compute = summary["compute-bound"]["median_comm_share"]
    expected = comm > 0.5 > compute
    print(f"\nmedian communication share: {comm:.2f} (communication-bound), {compute:.2f} "
          f"(compute-bound): {'as expected' if expected else 'NOT as expected'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "warmup": args.warmup, "reps": args.reps,
                               "runs": runs, "summary": summary, "as_expected": expected},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
