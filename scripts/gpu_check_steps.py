"""The steps of `scripts/gpu-check.sh`: what each runs, what it needs, and the numbers it reads.

Each `Step` is data: the commands (argument lists, run from the repository root), the Python
modules it needs, whether it needs a CUDA GPU, its time budget (full and --quick), and a
`read` function that turns what the commands left in the output folder into numbers, tables
and targets for the report. The runner (`gpu_check.py`) decides pass / fail / skip.

This file imports only the standard library: torch is imported by the commands, never here,
so that the check reports a machine whose torch does not import instead of crashing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DP_OVERHEAD_TARGET_PCT = 2.0  # issue 32: tandem's DP step at world size 1 vs plain PyTorch
# What the environment step looks for (import name -> distribution name).
MODULES = {"torch": "torch", "numpy": "numpy", "cloudpickle": "cloudpickle", "tqdm": "tqdm",
           "matplotlib": "matplotlib", "mpi4py": "mpi4py", "pytest": "pytest",
           "pytest_timeout": "pytest-timeout", "lightning": "lightning", "tensorboard": "tensorboard"}


@dataclass
class Context:
    """What every step sees: where to write, which mode, what the machine has."""

    out: Path
    quick: bool
    python: str
    machine: dict = field(default_factory=dict)  # the environment step's probe
    # Where the GPU benchmarks put their tensors: "cpu" only in tests of this script's wiring.
    device: str = "cuda"

    @property
    def cuda(self) -> bool:
        return bool(self.machine.get("cuda"))

    def has(self, module: str) -> bool:
        return bool(self.machine.get("modules", {}).get(module))


@dataclass
class Outcome:
    """What a step's `read` found: numbers for the JSON, tables and lines for the markdown."""

    numbers: dict = field(default_factory=dict)
    tables: list[dict] = field(default_factory=list)  # {"title", "columns", "rows"}
    targets: list[dict] = field(default_factory=list)  # {"what", "value", "target", "met"}
    notes: list[str] = field(default_factory=list)
    status: str | None = None  # overrides the exit-code verdict (pytest: all skipped)
    reason: str = ""


@dataclass
class Step:
    name: str
    title: str
    commands: Callable[[Context], list[list[str]]]
    budget_s: float
    quick_budget_s: float
    needs_cuda: bool = False
    needs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    read: Callable[[Context, str], Outcome] = lambda ctx, log: Outcome()


# --- environment ---------------------------------------------------------------------------


def probe(path: str) -> None:
    """Run as `gpu_check.py --probe FILE`: what this machine's Python offers, as JSON."""
    info: dict = {"python": platform.python_version(), "executable": sys.executable,
                  "platform": platform.platform(), "cores": len(os.sched_getaffinity(0))}
    modules = {}
    for name, dist in MODULES.items():
        if importlib.util.find_spec(name) is None:
            modules[name] = None
            continue
        try:
            modules[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            modules[name] = "present"
    info["modules"] = modules
    Path(path).write_text(json.dumps(info, indent=2))  # what is known if torch fails below
    import torch

    import tandem

    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda=torch.cuda.is_available(),
                gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                tandem=str(Path(tandem.__file__).parent))
    if info["cuda"]:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        from tandem.launch.mpi.mpiexec import find_mpiexec

        info["mpiexec"] = find_mpiexec()
    except Exception as error:  # reported, not fatal: the MPI parts skip themselves
        info["mpiexec"] = f"not found: {error}"
    Path(path).write_text(json.dumps(info, indent=2))


def _environment_commands(ctx: Context) -> list[list[str]]:
    probe_to = str(ctx.out / "environment.json")
    return [[ctx.python, str(ROOT / "scripts" / "gpu_check.py"), "--probe", probe_to]]


def _read_environment(ctx: Context, log: str) -> Outcome:
    path = ctx.out / "environment.json"
    ctx.machine = json.loads(path.read_text()) if path.exists() else {}
    m = ctx.machine
    missing = sorted(name for name, version in m.get("modules", {}).items() if not version)
    gpus = ", ".join(m.get("gpus", [])) or "none visible"
    notes = [f"torch {m.get('torch', '?')} (CUDA build {m.get('torch_cuda')}), GPUs: {gpus}, "
             f"{m.get('cores', '?')} cores, Python {m.get('python', '?')}",
             f"tandem imported from {m.get('tandem', '?')}; mpiexec: {m.get('mpiexec', '?')}",
             f"modules missing: {', '.join(missing) or 'none'}"]
    return Outcome(numbers=m, notes=notes)


def _doctor_commands(ctx: Context) -> list[list[str]]:
    return [[ctx.python, "-m", "tandem", "doctor"]]


def _read_doctor(ctx: Context, log: str) -> Outcome:
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("$ ")]
    return Outcome(notes=lines[-12:])


# --- the CUDA tests --------------------------------------------------------------------------

CUDA_TESTS = ("tests/test_cuda.py", "tests/test_cuda_parallel.py")


def _pytest_commands(ctx: Context) -> list[list[str]]:
    command = [ctx.python, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={ctx.out / 'cuda-tests.xml'}", *CUDA_TESTS]
    if ctx.has("pytest_timeout"):
        command.append("--timeout=150")
    return [command]


def _read_pytest(ctx: Context, log: str) -> Outcome:
    """Counts, failing tests and skip reasons from the JUnit XML (the -v log if it is missing)."""
    results: dict[str, tuple[str, str]] = {}
    xml = ctx.out / "cuda-tests.xml"
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            found = [child for child in case if child.tag in ("failure", "error", "skipped")]
            if not found:
                results[name] = ("passed", "")
            else:
                kind = {"failure": "failed", "error": "failed", "skipped": "skipped"}[found[0].tag]
                results[name] = (kind, (found[0].get("message") or "").strip())
    else:  # killed at its deadline: the -v lines say how far it got
        for line in log.splitlines():
            parts = line.split()
            if len(parts) >= 2 and "::" in parts[0] and parts[1] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
                results[parts[0]] = ({"PASSED": "passed", "SKIPPED": "skipped"}.get(parts[1], "failed"), "")
    kinds = [kind for kind, _ in results.values()]
    counts = {kind: kinds.count(kind) for kind in ("passed", "failed", "skipped")}
    skips = [reason.removeprefix("Skipped: ") for kind, reason in results.values() if kind == "skipped"]
    reasons = sorted(set(filter(None, skips)), key=lambda reason: -skips.count(reason))  # commonest first
    rows = [[name, kind, reason[:160]] for name, (kind, reason) in sorted(results.items())]
    outcome = Outcome(numbers={**counts, "tests": {n: k for n, (k, _) in results.items()}},
                      tables=[{"title": "tests", "columns": ["test", "result", "message"], "rows": rows}])
    outcome.notes.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    outcome.notes += [f"skipped because: {reason}" for reason in reasons]
    if results and counts["passed"] == counts["failed"] == 0:
        outcome.status, outcome.reason = "skipped", "; ".join(reasons) or "every test skipped"
    return outcome


# --- benchmarks ------------------------------------------------------------------------------


def _dp_commands(ctx: Context) -> list[list[str]]:
    size = (["--models", "resnet9", "--batch", "8", "--steps", "2", "--reps", "2", "--warmup", "1"]
            if ctx.quick else ["--models", "resnet9,gpt", "--batch", "resnet9=256,gpt=8", "--steps", "30",
                               "--reps", "5", "--warmup", "5"])
    return [[ctx.python, "benchmarks/dp_vs_ddp.py", "-np", "1", "--device", ctx.device, "--dtype", "bf16",
             *size, "--out", str(ctx.out / "dp_overhead.json")]]


def _read_dp(ctx: Context, log: str) -> Outcome:
    result = json.loads((ctx.out / "dp_overhead.json").read_text())
    rows, targets, numbers = [], [], {}
    for model, entry in result["models"].items():
        ms = {label: 1e3 * s for label, s in entry["step_s"].items()}
        # Weak efficiency at world size 1 = plain step time / wrapped step time (paired per rep).
        overhead = {label: 100 * (1 / eff - 1) for label, eff in entry["efficiency"].items()}
        numbers[model] = {"step_ms": ms, "overhead_pct": overhead, "per_rank_batch": entry["per_rank_batch"]}
        rows.append([model, entry["per_rank_batch"], f"{ms['single']:.2f}", f"{ms['tandem']:.2f}",
                     f"{overhead['tandem']:+.2f}", f"{ms.get('ddp', float('nan')):.2f}",
                     f"{overhead.get('ddp', float('nan')):+.2f}"])
        targets.append({"what": f"tandem DP overhead, {model} bf16, world size 1",
                        "value": round(overhead["tandem"], 3), "target": f"<= {DP_OVERHEAD_TARGET_PCT} %",
                        "met": overhead["tandem"] <= DP_OVERHEAD_TARGET_PCT})
    where = result.get("gpu") or result["config"]["device"]
    table = {"title": f"DP step at world size 1 on {where}, bf16 autocast ({result['backend']})",
             "columns": ["model", "batch", "plain ms", "tandem ms", "tandem overhead %", "DDP ms",
                         "DDP overhead %"], "rows": rows}
    return Outcome(numbers=numbers, tables=[table], targets=targets)


def _collectives_commands(ctx: Context) -> list[list[str]]:
    backends = "gloo,mpi,nccl" if ctx.device == "cuda" else "gloo,mpi"
    size = ["--max-size", "64KB", "--budget", "0.05"] if ctx.quick else ["--budget", "0.3"]
    return [[ctx.python, "-m", "tandem.bench.allreduce", "--device", ctx.device, "--backends", backends,
             "-np", "2", *size, "--out", str(ctx.out / "collectives.json")]]


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _read_collectives(ctx: Context, log: str) -> Outcome:
    result = json.loads((ctx.out / "collectives.json").read_text())
    times, tables = result["time_us"], []
    for prefix in ("gloo", "mpi", "nccl"):
        if f"{prefix}_raw" not in times:
            continue
        rows = []
        for i, nbytes in enumerate(result["sizes"]):
            raw, tandem = times[f"{prefix}_raw"][i], times[f"{prefix}_tandem"][i]
            rows.append([_size(nbytes), f"{raw:.1f}", f"{times[f'{prefix}_hot'][i]:.1f}", f"{tandem:.1f}",
                         f"{times[f'{prefix}_tandem_checks'][i]:.1f}", f"{tandem / raw:.2f}"])
        tables.append({"title": f"{prefix}: tensors on {result['device']}, {result['ranks'].get(prefix)} "
                                f"rank(s), us per all-reduce", "rows": rows,
                       "columns": ["size", "raw", "tandem hot", "tandem", "tandem+checks", "tandem/raw"]})
    notes = [f"{backend}: skipped, {why}" for backend, why in result.get("skipped", {}).items()]
    return Outcome(numbers={"time_us": times, "sizes": result["sizes"], "ranks": result["ranks"]},
                   tables=tables, notes=notes)


def _throughput_commands(ctx: Context) -> list[list[str]]:
    if ctx.device != "cuda":  # the wiring's test: every line of it, on a tiny model, in seconds
        size = ["--dry-run"]
    elif ctx.quick:
        size = ["--compile", "off", "--steps", "5", "--reps", "2", "--warmup", "2"]
    else:
        size = ["--compile", "off,on", "--steps", "10", "--reps", "3", "--warmup", "3"]
    return [[ctx.python, "benchmarks/gpt_throughput.py", "--device", ctx.device, *size,
             "--out", str(ctx.out / "throughput.json")]]


def _read_throughput(ctx: Context, log: str) -> Outcome:
    result = json.loads((ctx.out / "throughput.json").read_text())
    rows, targets = [], []
    for row in result["rows"].values():
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}"
        ratio = "-" if row["vs_torch"] is None else f"{row['vs_torch']:.3f}"
        rows.append([row["method"], row["compile"], f"{1e3 * row['step_s']:.1f}",
                     f"{row['tokens_per_s']:.0f}", mfu, ratio])
        if row["method"].startswith("td_") and row["vs_torch"] is not None:
            torch_own = "torch's fully_shard" if "fsdp" in row["method"] else "torch's DDP"
            targets.append({"what": f"{row['method']} tokens/s vs {torch_own}, compile "
                                    f"{row['compile']}", "value": round(row["vs_torch"], 3),
                            "target": ">= 1.0 (at or above torch's own)",
                            "met": row["vs_torch"] >= 0.99})  # within 1 %: the clock's noise
    model = result["model"]
    table = {"title": f"GPT ({model['layers']} layers, {model['dim']} wide, {model['seq']} tokens, "
                      f"vocab {model['vocab']}) on {result['card']}, {result['config']['dtype']}, "
                      f"batch {result['config']['batch']}; MFU against {result['peak_tflops']} "
                      f"TFLOP/s dense bf16",
             "columns": ["method", "compile", "ms/step", "tokens/s", "MFU %", "vs torch's own"],
             "rows": rows}
    notes = [f"{result['flops_per_token'] / 1e9:.2f} GFLOPs per token (6 N + 12 L d T); "
             "vs torch's own: td_ddp and td_opt against torch_ddp, td_fsdp against torch_fsdp"]
    return Outcome(numbers=result, tables=[table], targets=targets, notes=notes)


def _scale_commands(ctx: Context) -> list[list[str]]:
    sizes, steps, warmup = ("1,2", "3", "1") if ctx.quick else ("1,2,4,8", "20", "3")
    script = ["--hidden", "16", "--batch", "64", "--samples", "512"] if ctx.quick else \
        ["--hidden", "256", "--batch", "1024", "--samples", "16384"]
    return [[ctx.python, "-m", "tandem", "scale", "--np", sizes, "--steps", steps, "--warmup", warmup,
             "--out", str(ctx.out / "scale"), "tests/scripts/scale_train.py", *script]]


def _read_scale(ctx: Context, log: str) -> Outcome:
    report = json.loads((ctx.out / "scale" / "scaling.json").read_text())
    rows = [[r["np"], f"{r['samples_per_s']:.0f}", f"{r['speedup']:.2f}", f"{100 * r['efficiency']:.0f}",
             f"{1e3 * r['step_s']:.2f}", f"{1e3 * r['comm_s']:.2f}",
             "oversubscribed" if r["oversubscribed"] else ""] for r in report["rows"]]
    table = {"title": f"{report['command']} ({report['cores']} cores, backend {report['backend']}, "
                      f"{report['threads_per_rank']} thread(s) per rank)",
             "columns": ["ranks", "samples/s", "speedup", "efficiency %", "step ms", "comm ms", ""],
             "rows": rows}
    return Outcome(numbers={"rows": report["rows"], "backend": report["backend"]}, tables=[table])


STEPS = (
    Step("environment", "Python, torch, CUDA, GPUs and modules of this machine",
         _environment_commands, 20, 20, read=_read_environment),
    Step("doctor", "tandem doctor", _doctor_commands, 20, 20, read=_read_doctor),
    Step("cuda-tests", "tests/test_cuda.py and tests/test_cuda_parallel.py (DP on one shared GPU over "
         "Gloo and MPI, a world of one on NCCL, recipes, fully_shard, tensor parallel, pipeline, a "
         "side stream, no host sync, torch.compile)", _pytest_commands, 230, 60, needs=("pytest",),
         read=_read_pytest),
    Step("dp-overhead", "tandem's DP step vs plain PyTorch at world size 1: ResNet-9 and a GPT-style "
         "decoder, bf16", _dp_commands, 70, 30, needs_cuda=True, read=_read_dp),
    Step("collectives", "all-reduce of CUDA tensors, 4 KB-256 MB: Gloo, MPI and NCCL, raw vs tandem",
         _collectives_commands, 110, 30, needs_cuda=True, needs=("cloudpickle",), read=_read_collectives),
    Step("throughput", "tokens/s and MFU of a GPT-2-small-sized model, bf16, compile off and on, "
         "one GPU: td.DistributedDataParallel, td.DistributedOptimizer, td.fully_shard against "
         "torch's DistributedDataParallel and fully_shard", _throughput_commands, 240, 60,
         needs_cuda=True, read=_read_throughput),
    # The CPU cores, also on a GPU machine: the GPU hidden, so ranks need not share it.
    Step("scale", "tandem scale on the CPU cores (GPU hidden)", _scale_commands, 80, 45,
         env={"CUDA_VISIBLE_DEVICES": ""}, read=_read_scale),
)
