"""GPU validation in one command: run every check, write report.md and report.json to a folder.

    scripts/gpu-check.sh OUT             # the full run: about 9 minutes at most on a GPU machine
    scripts/gpu-check.sh OUT --quick     # the short run: CPU parts only at a smaller size
    scripts/gpu-check.sh OUT --only cuda-tests,dp-overhead
    scripts/gpu-check.sh --vendor .gpu-deps   # on a machine with them: copy the pure-Python
                                               # helpers (pytest, cloudpickle) for one without

Each step (`gpu_check_steps.STEPS`) runs as subprocesses from the repository root, with
`src` (and `.gpu-deps`, when present) on PYTHONPATH, so nothing is installed and no package
index is asked. A step gets a time budget; one that runs past it is stopped (its process
tree ended) and marked failed, and the next one starts: a step's failure never stops the
others. Steps that need a CUDA GPU are skipped, with the reason, where there is none, and so
are steps whose Python modules are missing. The whole run keeps to `--deadline` seconds.

The exit code is 1 when a step failed, else 0 (skips are not failures). The last line printed
is the one-line summary. Only the standard library is imported here: torch is the steps'.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from gpu_check_steps import ROOT, STEPS, Context, Outcome, Step, probe

DEPS = ROOT / ".gpu-deps"
# Pure-Python distributions `--vendor` copies: what the steps need beyond torch, numpy and MPI.
VENDORED = ("pytest", "pluggy", "iniconfig", "packaging", "pytest-timeout", "cloudpickle",
            "exceptiongroup", "tomli", "pygments")
GRACE_S = 5.0  # between SIGTERM and SIGKILL for a step past its budget


def _environment() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "src")] + ([str(DEPS)] if DEPS.is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (read from Linux's /proc; on other systems `pid` alone)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(parents.get(current, []))
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(process: subprocess.Popen) -> None:
    """End a step's process tree: SIGTERM to each process (launchers stop their ranks), then,
    after a grace period, SIGKILL to whatever is left of it."""
    pids = _tree(process.pid)
    _signal(pids, signal.SIGTERM)
    try:
        process.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pids += _tree(process.pid)
    _signal([pid for pid in set(pids) if Path(f"/proc/{pid}").exists()], signal.SIGKILL)
    process.wait()


def run_step(step: Step, ctx: Context, budget: float, log_path: Path) -> dict:
    """Run the step's commands under one budget; return its record for the report."""
    commands = step.commands(ctx)
    record = {"name": step.name, "title": step.title, "needs_cuda": step.needs_cuda,
              "budget_s": round(budget), "commands": [" ".join(c) for c in commands],
              "log": str(log_path.relative_to(ctx.out))}
    start = time.monotonic()
    env = {**_environment(), **step.env}
    status, reason = "passed", ""
    with open(log_path, "w") as log:
        for command in commands:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            left = budget - (time.monotonic() - start)
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
            try:
                code = process.wait(max(left, 1.0))
            except subprocess.TimeoutExpired:
                _stop(process)
                status, reason = "failed", f"stopped at its budget of {budget:.0f} s"
                break
            if code != 0:
                status, reason = "failed", f"exit code {code}"
                break
    record["seconds"] = round(time.monotonic() - start, 1)
    text = log_path.read_text(errors="replace")
    try:
        outcome = step.read(ctx, text)
    except Exception as error:  # a result that cannot be read is a failed step, named
        outcome = Outcome()
        if status == "passed":
            status, reason = "failed", f"its results could not be read: {type(error).__name__}: {error}"
    if outcome.status and status == "passed":  # pytest exits 0 when every test skipped
        status, reason = outcome.status, outcome.reason
    record.update({k: v for k, v in asdict(outcome).items() if k not in ("status", "reason")})
    record.update(status=status, reason=reason)
    if status == "failed":
        record["log_tail"] = text.splitlines()[-25:]
    return record


def _skip(step: Step, reason: str) -> dict:
    return {"name": step.name, "title": step.title, "needs_cuda": step.needs_cuda, "status": "skipped",
            "reason": reason, "seconds": 0.0, "budget_s": 0, "commands": [], "numbers": {},
            "tables": [], "targets": [], "notes": []}


def why_skip(step: Step, ctx: Context) -> str | None:
    if step.name != "environment" and not ctx.machine.get("torch"):
        return "torch does not import here (see the environment step)"
    if step.needs_cuda and not ctx.cuda:
        m = ctx.machine
        return f"needs a CUDA GPU: none visible (torch {m.get('torch')}, CUDA build {m.get('torch_cuda')})"
    missing = [name for name in step.needs if not ctx.has(name)]
    if missing:
        return (f"needs {', '.join(missing)}, not installed here (bring it: scripts/gpu-check.sh "
                f"--vendor .gpu-deps on a machine that has it; README, GPU check)")
    return None


def summary_line(report: dict) -> str:
    counts = {s: sum(1 for r in report["steps"] if r["status"] == s) for s in ("passed", "failed", "skipped")}
    targets = [t for r in report["steps"] for t in r["targets"]]
    verdict = "FAIL" if counts["failed"] else "PASS"
    gpu = ", ".join(report["environment"].get("gpus") or []) or "no CUDA GPU"
    failed = [r["name"] for r in report["steps"] if r["status"] == "failed"]
    return (f"gpu-check {verdict}: {counts['passed']} passed, {counts['failed']} failed"
            f"{' (' + ', '.join(failed) + ')' if failed else ''}, {counts['skipped']} skipped; "
            f"targets met {sum(t['met'] for t in targets)}/{len(targets)}; {gpu}; "
            f"{report['seconds']:.0f} s; {report['out']}/report.md")


def write_markdown(report: dict, path: Path) -> None:
    env = report["environment"]
    lines = ["# tandem GPU check", "", f"`{report['summary']}`", "",
             f"Mode {report['mode']}, started {report['started']}, torch {env.get('torch')} "
             f"(CUDA build {env.get('torch_cuda')}), GPUs: {', '.join(env.get('gpus') or []) or 'none'}, "
             f"{env.get('cores')} cores, Python {env.get('python')}.", "",
             "| step | status | seconds | budget | reason |", "|---|---|---|---|---|"]
    for r in report["steps"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']} | {r['budget_s']} | {r['reason']} |")
    for r in report["steps"]:
        lines += ["", f"## {r['name']}: {r['status']}", "", r["title"] + "."]
        if r["reason"]:
            lines += ["", f"{r['status'].capitalize()}: {r['reason']}."]
        lines += [""] + [f"    {c}" for c in r["commands"]] if r["commands"] else []
        lines += [""] + [f"- {note}" for note in r["notes"]] if r["notes"] else []
        for t in r["targets"]:
            lines.append(f"- target: {t['what']}: {t['value']} ({t['target']}): "
                         f"{'met' if t['met'] else 'MISSED'}")
        for table in r["tables"]:
            lines += ["", f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |",
                      "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
        if r.get("log_tail"):
            lines += ["", f"Last lines of {r['log']}:", "", "```", *r["log_tail"], "```"]
    path.write_text("\n".join(lines) + "\n")


def check(out: Path, quick: bool, only: list[str] | None, deadline: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    ctx = Context(out=out.resolve(), quick=quick, python=sys.executable)
    started, start = time.strftime("%Y-%m-%d %H:%M:%S %z"), time.monotonic()
    records = []
    for step in STEPS:
        if only and step.name not in only and step.name != "environment":
            continue
        left = deadline - (time.monotonic() - start)
        reason = why_skip(step, ctx)
        if reason is None and left < 10:
            reason = f"no time left of the run's {deadline:.0f} s deadline"
        if reason is not None:
            records.append(_skip(step, reason))
        else:
            budget = min(step.quick_budget_s if quick else step.budget_s, left)
            print(f"gpu-check: {step.name} (budget {budget:.0f} s) ...", flush=True)
            records.append(run_step(step, ctx, budget, ctx.out / "logs" / f"{step.name}.log"))
        print(f"gpu-check: {step.name}: {records[-1]['status']} {records[-1]['reason']}".rstrip(), flush=True)
    report = {"tool": "scripts/gpu-check.sh", "mode": "quick" if quick else "full", "started": started,
              "seconds": round(time.monotonic() - start, 1), "out": str(ctx.out), "deadline_s": deadline,
              "environment": ctx.machine, "cuda": ctx.cuda, "steps": records}
    report["summary"] = summary_line(report)
    report["exit_code"] = 1 if any(r["status"] == "failed" for r in records) else 0
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_markdown(report, ctx.out / "report.md")
    print(report["summary"], flush=True)
    return report["exit_code"]


def vendor(folder: Path) -> int:
    """Copy the pure-Python distributions in VENDORED from this interpreter into `folder`."""
    import importlib.metadata

    folder.mkdir(parents=True, exist_ok=True)
    for name in VENDORED:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            print(f"vendor: {name} is not installed here, left out")
            continue
        files = [f for f in dist.files or [] if not str(f).startswith("..")]
        if any(str(f).endswith((".so", ".pyd", ".dylib")) for f in files):
            print(f"vendor: {name} has compiled parts (not portable), left out")
            continue
        for f in files:
            source = Path(dist.locate_file(f))
            if source.is_file() and "__pycache__" not in f.parts:
                (folder / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, folder / f)
        print(f"vendor: {name} {dist.version}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="folder for report.md, report.json, logs and results")
    parser.add_argument("--quick", action="store_true", help="the short run (CPU parts at a small size)")
    parser.add_argument("--only", default="", help="comma-separated step names: " +
                        ", ".join(s.name for s in STEPS))
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole run (540; --quick: 150)")
    parser.add_argument("--vendor", metavar="DIR", help="copy pytest & co. into DIR, then exit")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        probe(args.probe)
        return 0
    if args.vendor:
        return vendor(Path(args.vendor))
    if not args.out:
        parser.error("give the folder for the report: scripts/gpu-check.sh OUT [--quick]")
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"--only: unknown step(s) {unknown}; the steps are {[s.name for s in STEPS]}")
    if (Path(args.out) / "report.json").exists():  # its result files would be read as this run's
        parser.error(f"{args.out} already holds a report: give a new folder")
    deadline = args.deadline if args.deadline is not None else (150.0 if args.quick else 540.0)
    return check(Path(args.out), args.quick, only or None, deadline)


if __name__ == "__main__":
    sys.exit(main())
