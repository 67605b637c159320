"""`tandem scale`: run a training script at several world sizes and say how well it scales.

    tandem scale --np 1,2,4 --steps 20 train.py --lr 0.1
    tandem scale --np 1,2 --mode weak --out results/scale train.py

For each world size the script runs as a fresh `tandem run` job. Its ranks are told through
`TANDEM_SCALE_*` variables to stop after `--warmup` + `--steps` optimizer steps and to write
what `tandem.diagnostics.steps` recorded (step wall time, exposed communication, data loading,
samples). The driver then prints one row per world size and writes `scaling.json` and
`scaling.png` to `--out`.

Modes. `strong` (default) keeps the global batch: each of N ranks gets 1/N of it, so the ideal
is N times fewer seconds per step. `weak` keeps the per-rank batch: `td.partition_dataset`
multiplies the script's `batch_size` by N, so the ideal is a constant step time. Either way
`speedup` is the throughput (samples/s) relative to the smallest world size and `efficiency`
is speedup / (N / smallest N).

Resources. Each rank gets `--threads-per-rank` threads, by default `cores // max(N)` (at
least 1), the same at every world size: adding ranks adds cores, as adding GPUs would. A world
that needs more threads than the machine has cores is marked `oversubscribed`; its timing
says little about the script.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

MODES = ("strong", "weak")


class ScaleError(RuntimeError):
    """A world size could not be measured; the message says which and why."""


@dataclass(frozen=True)
class ScaleConfig:
    """One scaling analysis: which script, which world sizes, how many steps."""

    nps: tuple[int, ...]
    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    mode: str = "strong"
    steps: int = 20
    warmup: int = 3
    out: str = "results/scale"
    backend: str | None = None
    threads_per_rank: int | None = None  # None: cores // max(nps), at least 1
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not self.nps:
            raise ValueError("--np: give at least one world size, e.g. --np 1,2,4")
        bad = [n for n in self.nps if n < 1]
        if bad:
            raise ValueError(f"--np {','.join(map(str, self.nps))}: world sizes must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"--mode {self.mode!r}: choose 'strong' or 'weak'")
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps}: measure at least 1 step")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}: give 0 or more warm-up steps")
        from tandem.diagnostics.steps import CAPACITY

        if self.warmup + self.steps > CAPACITY:
            raise ValueError(f"--warmup {self.warmup} + --steps {self.steps}: each rank keeps "
                             f"the last {CAPACITY} steps; measure fewer")


@dataclass
class Row:
    """The measurement at one world size. Times are seconds per step (means)."""

    np: int
    samples_per_s: float
    speedup: float
    efficiency: float
    step_s: float
    compute_s: float
    comm_s: float
    data_s: float
    global_batch: float
    measured_steps: int
    oversubscribed: bool = False
    notes: list[str] = field(default_factory=list)


def parse_sizes(text: str) -> tuple[int, ...]:
    """`"1,2,4"` -> (1, 2, 4): sorted, without repeats."""
    try:
        sizes = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--np {text!r}: give world sizes separated by commas, e.g. 1,2,4") from None
    if not sizes:
        raise ValueError(f"--np {text!r}: give at least one world size, e.g. 1,2,4")
    return tuple(sorted(sizes))


def default_sizes() -> tuple[int, ...]:
    """1, 2, 4, ... up to the number of cores (at least 1 and 2)."""
    sizes, n = [1, 2], 4
    while n <= cores():
        sizes.append(n)
        n *= 2
    return tuple(sizes)


def cores() -> int:
    from tandem.launch.local.processes import cores as usable_cores

    return usable_cores()


def threads_per_rank(config: ScaleConfig) -> int:
    return config.threads_per_rank or max(1, cores() // max(config.nps))


# --- analysis (pure) ---------------------------------------------------------------------------


def summarize(np: int, ranks: Sequence[Mapping], warmup: int) -> Row:
    """One world size's row from its ranks' record files (speedup/efficiency filled later).

    Step i lasts as long as its slowest rank; its samples are the sum over ranks; exposed
    communication and data loading are averaged over ranks.
    """
    if not ranks:
        raise ScaleError(
            f"world size {np}: the script finished without a single optimizer step recorded. "
            "tandem scale measures td.DistributedOptimizer.step(): wrap the optimizer with it "
            "(see docs/scaling.md)."
        )
    if len(ranks) != np:
        have = sorted(int(r["rank"]) for r in ranks)
        raise ScaleError(f"world size {np}: records from ranks {have} only; expected {np} ranks")
    steps = [list(r["steps"])[warmup:] for r in sorted(ranks, key=lambda r: r["rank"])]
    count = min(len(s) for s in steps)
    if count == 0:
        recorded = {int(r["rank"]): len(r["steps"]) for r in ranks}
        raise ScaleError(
            f"world size {np}: no step after the {warmup} warm-up step(s) was recorded "
            f"(steps recorded per rank: {recorded}). Does the script step a "
            "td.DistributedOptimizer, and run long enough? Lower --warmup or lengthen the run."
        )
    wall = [max(s[i]["wall_s"] for s in steps) for i in range(count)]
    samples = [sum(s[i]["samples"] for s in steps) for i in range(count)]
    comm = statistics.fmean(s[i]["comm_s"] for s in steps for i in range(count))
    data = statistics.fmean(s[i]["data_s"] for s in steps for i in range(count))
    if sum(samples) == 0:
        raise ScaleError(
            f"world size {np}: the steps carry no sample counts. Load batches with "
            "td.partition_dataset, or call td.metrics.report(samples=<per-rank batch>) in the script."
        )
    step_s = statistics.fmean(wall)
    notes = []
    planned = ranks[0].get("planned_steps")
    if planned is not None and count < planned:
        notes.append(f"script ended after {count} of {planned} measured steps")
    return Row(
        np=np, samples_per_s=sum(samples) / sum(wall), speedup=1.0, efficiency=1.0,
        step_s=step_s, compute_s=max(0.0, step_s - comm - data), comm_s=comm, data_s=data,
        global_batch=statistics.fmean(samples), measured_steps=count, notes=notes,
    )


def relate(rows: list[Row]) -> list[Row]:
    """Fill speedup and efficiency relative to the smallest world size."""
    rows = sorted(rows, key=lambda row: row.np)
    base = rows[0]
    for row in rows:
        row.speedup = row.samples_per_s / base.samples_per_s
        row.efficiency = row.speedup / (row.np / base.np)
    return rows


# --- running -------------------------------------------------------------------------------------


@contextmanager
def _environment(values: Mapping[str, str]):
    """Set variables for the launched job (the launcher hands our environment to the ranks)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _read_ranks(directory: str) -> list[dict]:
    found = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as file:
                found.append(json.load(file))
    return found


def measure(config: ScaleConfig, np: int) -> Row:
    """Run the script as a job of `np` ranks and summarise its records."""
    from tandem.launch import LaunchConfig, launch

    directory = os.path.join(config.out, f"np{np}")
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # records of an earlier analysis must not count
        if name.startswith("rank") and name.endswith(".json"):
            os.remove(os.path.join(directory, name))
    variables = {
        "TANDEM_SCALE_STEPS": str(config.steps),
        "TANDEM_SCALE_WARMUP": str(config.warmup),
        "TANDEM_SCALE_MODE": config.mode,
        "TANDEM_SCALE_OUT": os.path.abspath(directory),
    }
    job = LaunchConfig(
        np=np, program=config.program, args=config.args, module=config.module,
        backend=config.backend, threads_per_rank=threads_per_rank(config), timeout=config.timeout,
    )
    with _environment(variables):
        code = launch(job)
    if code != 0:
        raise ScaleError(f"world size {np}: the job failed with exit code {code} (see its output "
                         "above); fix the script at this size, or leave the size out of --np")
    row = summarize(np, _read_ranks(directory), config.warmup)
    row.oversubscribed = np * threads_per_rank(config) > cores()
    return row


def run(config: ScaleConfig, echo=print) -> dict:
    """Measure every world size, print the table, write `scaling.json` and `scaling.png`."""
    rows = []
    for np in config.nps:
        echo(f"tandem scale: world size {np} ({config.mode} scaling, "
             f"{config.warmup} + {config.steps} steps)")
        rows.append(measure(config, np))
    report = build_report(config, relate(rows))
    echo(format_table(report))
    json_path = os.path.join(config.out, "scaling.json")
    with open(json_path, "w") as file:
        json.dump(report, file, indent=2)
    from tandem.bench import plots

    try:
        png_path = plots.plot_scaling(report, os.path.join(config.out, "scaling.png"))
    except ImportError as error:
        # matplotlib is a declared dependency, yet a machine with its own torch and no package
        # index (a GPU box) may lack it: the table and the JSON are the analysis, keep them.
        echo(f"wrote {json_path}; scaling.png not drawn ({error}; pip install matplotlib)")
        return report
    echo(f"wrote {json_path} and {png_path}")
    return report


def chosen_backend(config: ScaleConfig) -> str:
    """The backend the jobs ran on: --backend, else `tandem run`'s choice for them."""
    from tandem.launch import LaunchConfig
    from tandem.launch.launcher import with_backend

    job = LaunchConfig(np=max(config.nps), program=config.program, module=config.module,
                       backend=config.backend)
    return with_backend(job).backend


def build_report(config: ScaleConfig, rows: Sequence[Row]) -> dict:
    command = " ".join(["tandem scale", "--np", ",".join(map(str, config.nps)),
                        "--mode", config.mode, "--steps", str(config.steps),
                        "--warmup", str(config.warmup),
                        *(["-m"] if config.module else []), config.program, *config.args])
    return {
        "command": command,
        "program": config.program,
        "mode": config.mode,
        "steps": config.steps,
        "warmup": config.warmup,
        "cores": cores(),
        "threads_per_rank": threads_per_rank(config),
        "backend": chosen_backend(config),
        "rows": [asdict(row) for row in rows],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def format_table(report: Mapping) -> str:
    """The rows as a fixed-width table, with a legend line."""
    header = (f"{'ranks':>5} {'samples/s':>10} {'speedup':>8} {'effic.':>7} {'batch':>6} "
              f"{'step ms':>8} {'compute':>8} {'comm':>7} {'data':>6}")
    lines = [f"{report['mode']} scaling of {report['program']}: {report['cores']} cores, "
             f"{report['threads_per_rank']} thread(s) per rank, backend "
             f"{report.get('backend', '?')}", header, "-" * len(header)]
    for row in report["rows"]:
        line = (f"{row['np']:>5} {row['samples_per_s']:>10.1f} {row['speedup']:>7.2f}x "
                f"{row['efficiency'] * 100:>6.0f}% {row['global_batch']:>6.0f} "
                f"{_ms(row['step_s']):>8} {_ms(row['compute_s']):>8} {_ms(row['comm_s']):>7} "
                f"{_ms(row['data_s']):>6}")
        flags = (["oversubscribed"] if row["oversubscribed"] else []) + list(row["notes"])
        lines.append(line + (f"  ({'; '.join(flags)})" if flags else ""))
    lines.append("step = compute + exposed communication + data loading, ms per step (means); "
                 "batch = global samples per step")
    return "\n".join(lines)
