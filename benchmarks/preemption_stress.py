"""Preemption under stress: signals at random moments against a small 2-rank job (issue 44).

    python benchmarks/preemption_stress.py                         # 20 signals, Gloo and MPI
    python benchmarks/preemption_stress.py --signals 4 --backends gloo --moments save,twice,startup

One chain of `tandem run -np 2` jobs per backend trains tests/scripts/preemptible_steps.py
(a checkpoint after every step) into one directory. Each job gets SIGTERM at a moment drawn at
random (or taken in turn from --moments):

    step      while a step runs (a random point of it)
    save      as rank 0 starts a save (right after it prints `saving N`)
    startup   while the ranks are still starting (before the first step)
    twice     two SIGTERMs in a row during a step (the second means "stop now")

After each job: the exit status (75 "resume me"; a job stopped during start-up may also end
128+15), the newest checkpoint, loaded here with its checksums checked (a torn one would fail),
and the steps lost (steps rank 0 finished minus the newest checkpoint's). A SIGTERM that
reaches `tandem run` before it has set its own handlers kills it (exit -15): nothing had
started, nothing is lost; that is counted as a start-up stop. A job that does not
exit within --job-timeout is a hang (killed, counted). After the signals the chain runs to its
end and its parameters are compared with one uninterrupted process (1e-6). Prints a table and
writes every trial as JSON (`results/preemption_stress.json`); exit status 1 when an invariant
broke: a torn checkpoint, a hang, more than one step lost, another exit status, or another result.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import tandem as td
from tandem.bench.results import write_json
from tandem.checkpoint import steps_on_disk

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "preemptible_steps.py"
MOMENTS = ("step", "save", "startup", "twice")
# At start-up: 75 (armed, nothing to save yet), 128+15 (tandem run stopped ranks that had not
# armed yet), or -15 (tandem run itself had not set its handlers yet: nothing had started)
STARTUP_CODES = (75, 128 + signal.SIGTERM, -signal.SIGTERM)
_LINE = re.compile(r"^\[0\] (start|step|saving) (\d+)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _objects():
    """The script's model, optimizer and loader, to load a checkpoint into."""
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=generator),
                                          torch.randint(0, 3, (96,), generator=generator))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader, _ = td.partition_dataset(data, batch_size=12, seed=0, pad=False)
    return {"model": model, "optimizer": opt, "data": loader}


def newest_checkpoint(directory: Path) -> tuple[int, str | None]:
    """(completed steps of the newest checkpoint, None) once it loaded with its checksums
    checked; (steps, the error) when it did not: a torn checkpoint. (0, None): none yet."""
    try:
        on_disk = steps_on_disk.on_disk(directory) if directory.exists() else []
    except Exception as error:  # noqa: BLE001 - a directory that cannot be listed is torn
        return -1, f"{type(error).__name__}: {error}"
    if not on_disk:
        return 0, None
    completed, path = on_disk[0]
    try:
        record = td.checkpoint.load_sharded(path, **_objects())
    except Exception as error:  # noqa: BLE001 - whatever fails to load is what we count
        return completed, f"{type(error).__name__}: {error}"
    return int(record.get("completed", completed)), None


class Job:
    """A `tandem run` job whose output lines are read with deadlines."""

    def __init__(self, backend: str, directory: Path, out: Path, step_s: float, epochs: int):
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.stderr: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", backend, str(SCRIPT),
             str(directory), str(out), "--step-s", str(step_s), "--every", "1",
             "--epochs", str(epochs)],
            env=_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self.started = time.monotonic()
        self.reached = -1  # the last `start N` / `step N` rank 0 printed: steps finished
        threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True).start()

    def _read(self, pipe, is_stdout: bool) -> None:
        for line in pipe:
            if not is_stdout:
                self.stderr.append(line)
                continue
            found = _LINE.match(line.strip())
            if found:
                kind, number = found.group(1), int(found.group(2))
                if kind in ("start", "step"):
                    self.reached = max(self.reached, number)
                self.lines.put((kind, number))
        if is_stdout:
            self.lines.put(("eof", -1))

    def until(self, kinds: tuple[str, ...], deadline: float) -> tuple[str, int] | None:
        """The next line of one of `kinds` (after the first step), or None at EOF or the deadline."""
        while time.monotonic() < deadline:
            try:
                kind, number = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if kind == "eof":
                return None
            if kind in kinds:
                return kind, number
        return None

    def signal(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None (a hang: the job's group is killed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
            return None


def trial(backend: str, moment: str, directory: Path, out: Path, rng: random.Random,
          step_s: float, epochs: int, job_timeout: float) -> dict:
    before, _ = newest_checkpoint(directory)
    job = Job(backend, directory, out, step_s, epochs)
    deadline = job.started + job_timeout
    landed = moment
    if moment == "startup":
        # A random moment of the start-up: the ranks import, meet, restore.
        found = job.until(("start",), job.started + rng.uniform(0.2, 3.0))
        landed = "startup" if found is None else "after start-up"
        job.signal()
    elif moment == "save":
        landed = "save" if job.until(("saving",), deadline) else "no save seen"
        job.signal()
    else:
        landed = "step" if job.until(("step",), deadline) else "no step seen"
        time.sleep(rng.uniform(0, step_s))  # a random point of the next step
        job.signal()
        if moment == "twice":
            time.sleep(rng.uniform(0, 0.05))
            job.signal()
    sent = time.monotonic()
    code = job.wait(max(1.0, deadline - time.monotonic()))
    exited = time.monotonic()
    newest, torn = newest_checkpoint(directory)
    reached = max(job.reached, before)
    finished = code == 0 and out.exists()
    expected = (0, *STARTUP_CODES) if moment == "startup" else (0, 75)
    if moment == "twice":
        expected = (0, 75, 128 + signal.SIGTERM, 128 + signal.SIGKILL)
    result = {"backend": backend, "moment": moment, "landed": landed, "exit_code": code,
              "hang": code is None, "finished": finished, "checkpoint_before": before,
              "checkpoint_after": newest, "steps_reached": reached,
              "steps_lost": max(0, reached - newest), "torn": torn,
              "saved": code == 75 and "saved" in "".join(job.stderr) and newest > before,
              "signal_to_exit_s": round(exited - sent, 3)}
    result["ok"] = (code in expected and torn is None and result["steps_lost"] <= 1
                    and newest >= before)
    if not result["ok"]:
        result["stderr_tail"] = "".join(job.stderr[-20:])
    return result


def finish(backend: str, directory: Path, out: Path, reference: dict, epochs: int,
           job_timeout: float) -> float | None:
    """Run the chain to its end; the largest difference from one process (None: it failed)."""
    job = Job(backend, directory, out, 0.0, epochs)
    if job.wait(job_timeout) != 0 or not out.exists():
        print("".join(job.stderr[-20:]), file=sys.stderr)
        return None
    final = torch.load(out)
    return max((final[name] - value).abs().max().item() for name, value in reference.items())


def run(backends: list[str], signals: int, moments: list[str] | None, seed: int, step_s: float,
        job_timeout: float, workdir: Path) -> dict:
    rng = random.Random(seed)
    epochs = max(2, signals // 3 + 2)  # about 3 steps a job, and some left for the end
    reference_out = workdir / "reference.pt"
    subprocess.run([sys.executable, str(SCRIPT), str(workdir / "one"), str(reference_out),
                    "--step-s", "0", "--every", "1000", "--epochs", str(epochs)], env=_env(),
                   check=True, timeout=job_timeout, capture_output=True)
    reference = torch.load(reference_out)
    trials, finals = [], {}
    for backend in backends:
        directory, out = workdir / f"ckpt-{backend}", workdir / f"out-{backend}.pt"
        for number in range(signals):
            moment = moments[number % len(moments)] if moments else rng.choice(MOMENTS)
            result = trial(backend, moment, directory, out, rng, step_s, epochs, job_timeout)
            trials.append(result)
            print(f"[{backend} {number + 1}/{signals}] {moment} ({result['landed']}): exit "
                  f"{result['exit_code']}, checkpoint {result['checkpoint_before']} -> "
                  f"{result['checkpoint_after']}, lost {result['steps_lost']}"
                  f"{'' if result['ok'] else '  FAIL ' + str(result.get('torn') or '')}",
                  flush=True)
            if result["finished"]:  # the chain ended before its signal: start another
                shutil.rmtree(directory, ignore_errors=True)
                out.unlink(missing_ok=True)
        finals[backend] = finish(backend, directory, out, reference, epochs, job_timeout)
    return {"signals": signals, "step_s": step_s, "trials": trials, "final_max_diff": finals}


def summary(result: dict) -> dict[str, dict]:
    rows = {}
    for backend in sorted({t["backend"] for t in result["trials"]}):
        mine = [t for t in result["trials"] if t["backend"] == backend]
        rows[backend] = {
            "signals_sent": len(mine),
            "saves_completed": sum(t["saved"] for t in mine),
            "steps_lost_max": max((t["steps_lost"] for t in mine), default=0),
            "torn": sum(t["torn"] is not None for t in mine),
            "hangs": sum(t["hang"] for t in mine),
            "bad_exit": sum(t["exit_code"] is not None and not t["ok"] and t["torn"] is None
                            and t["steps_lost"] <= 1 for t in mine),
            "signal_to_exit_s_max": max((t["signal_to_exit_s"] for t in mine if not t["hang"]),
                                        default=0.0),
            "final_max_diff": result["final_max_diff"].get(backend),
        }
    return rows


def table(rows: dict[str, dict]) -> str:
    head = (f"{'backend':<8}{'signals':>8}{'saves':>7}{'lost max':>9}{'torn':>6}{'hangs':>6}"
            f"{'bad exit':>9}{'exit max (s)':>13}{'final diff':>12}")
    lines = [head]
    for backend, row in rows.items():
        diff = row["final_max_diff"]
        lines.append(f"{backend:<8}{row['signals_sent']:>8}{row['saves_completed']:>7}"
                     f"{row['steps_lost_max']:>9}{row['torn']:>6}{row['hangs']:>6}"
                     f"{row['bad_exit']:>9}{row['signal_to_exit_s_max']:>13.2f}"
                     f"{'failed' if diff is None else f'{diff:.1e}':>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signals", type=int, default=20, help="signals (jobs) per backend")
    parser.add_argument("--backends", default="gloo,mpi", help="comma-separated")
    parser.add_argument("--moments", default="",
                        help=f"take the moments in turn from these (some of {', '.join(MOMENTS)}) "
                             "instead of at random")
    parser.add_argument("--step-s", type=float, default=0.1, help="the script's seconds a step")
    parser.add_argument("--job-timeout", type=float, default=180.0,
                        help="seconds a job may take before it counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/preemption_stress.json")
    args = parser.parse_args(argv)
    moments = [m.strip() for m in args.moments.split(",") if m.strip()]
    unknown = set(moments) - set(MOMENTS)
    if unknown:
        parser.error(f"unknown moments {sorted(unknown)}: choose from {', '.join(MOMENTS)}")
    td.init()  # one process: the checkpoints are loaded here
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-preemption-stress-") as tmp:
            result = run([b.strip() for b in args.backends.split(",") if b.strip()], args.signals,
                         moments or None, args.seed, args.step_s, args.job_timeout, Path(tmp))
    finally:
        td.shutdown()
    rows = summary(result)
    result["summary"] = rows
    print(table(rows))
    print(f"wrote {write_json(result, args.out)}")
    failed = [t for t in result["trials"] if not t["ok"]]
    wrong = [b for b, diff in result["final_max_diff"].items() if diff is None or diff > 1e-6]
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
