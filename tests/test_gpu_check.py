"""`scripts/gpu-check.sh`, the one-command GPU validation, as it runs on a machine without a GPU.

The quick run is the real thing at a small size: every step present in the report, the CUDA
ones skipped with the reason, the CPU ones passed with their numbers. The GPU benchmarks' own
commands run here with `--device cpu` so that their wiring and the reading of their JSON are
tested before a GPU machine sees them. Then the runner's promises: a step that fails or runs
past its budget is recorded and stopped (its process tree with it) while the next steps still
run, and the exit code says so; `--vendor` brings pytest & co. to a machine without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
from gpu_check_steps import STEPS, Context, Outcome, Step  # noqa: E402

NAMES = ["environment", "doctor", "cuda-tests", "dp-overhead", "collectives", "throughput", "scale"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable}


@pytest.mark.timeout(200)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run scripts/gpu-check.sh itself")
def test_the_quick_run_skips_the_cuda_steps_and_passes_the_cpu_ones(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out), "--quick"],
                          env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert done.stdout.splitlines()[-1] == report["summary"]
    assert report["summary"].startswith("gpu-check PASS: 3 passed, 0 failed, 4 skipped;"), report["summary"]
    steps = {r["name"]: r for r in report["steps"]}
    assert [r["name"] for r in report["steps"]] == NAMES
    assert report["mode"] == "quick" and report["cuda"] is False and report["exit_code"] == 0
    for name in ("environment", "doctor", "scale"):
        assert steps[name]["status"] == "passed", steps[name]
    for name in ("dp-overhead", "collectives", "throughput"):
        assert steps[name]["status"] == "skipped", steps[name]
        assert steps[name]["reason"].startswith("needs a CUDA GPU: none visible"), steps[name]
    # The CUDA tests ran (pytest collected them) and every one said why it skipped.
    tests = steps["cuda-tests"]
    assert tests["status"] == "skipped" and "CUDA GPU" in tests["reason"], tests
    assert tests["numbers"]["passed"] == tests["numbers"]["failed"] == 0
    assert tests["numbers"]["skipped"] == len(tests["numbers"]["tests"]) >= 25
    assert "tests/test_cuda_parallel.py::test_fully_shard_on_the_gpu" in tests["numbers"]["tests"]
    assert all(row[2] for row in tests["tables"][0]["rows"]), "a skip without its reason"
    environment = steps["environment"]["numbers"]
    assert environment["torch"] == torch.__version__ and environment["tandem"] == str(ROOT / "src" / "tandem")
    assert [row["np"] for row in steps["scale"]["numbers"]["rows"]] == [1, 2]
    markdown = (out / "report.md").read_text()
    assert report["summary"] in markdown
    for name in NAMES:
        assert f"## {name}: {steps[name]['status']}" in markdown
    assert sorted(p.name for p in (out / "logs").iterdir()) == sorted(
        f"{name}.log" for name in NAMES if steps[name]["status"] != "skipped" or name == "cuda-tests")


@pytest.mark.timeout(360)
def test_the_gpu_benchmarks_commands_run_and_are_read_on_the_cpu(tmp_path):
    ctx = Context(out=tmp_path, quick=True, python=sys.executable, device="cpu")
    by_name = {step.name: step for step in STEPS}
    dp = gpu_check.run_step(by_name["dp-overhead"], ctx, 150, tmp_path / "dp.log")
    assert dp["status"] == "passed", dp
    (target,) = dp["targets"]
    assert target["what"] == "tandem DP overhead, resnet9 bf16, world size 1"
    assert isinstance(target["value"], float) and target["met"] == (target["value"] <= 2.0)
    assert dp["tables"][0]["rows"][0][:2] == ["resnet9", 8]
    collectives = gpu_check.run_step(by_name["collectives"], ctx, 150, tmp_path / "ar.log")
    assert collectives["status"] == "passed", collectives
    titles = [table["title"] for table in collectives["tables"]]
    assert titles[0] == "gloo: tensors on cpu, 2 rank(s), us per all-reduce", titles
    assert len(titles) == 2 or collectives["notes"], "MPI neither measured nor said to be skipped"
    assert [row[0] for row in collectives["tables"][0]["rows"]] == ["4 KB", "16 KB", "64 KB"]
    # the GPT throughput step: its --dry-run (a tiny model, eager and compiled) on the CPU
    throughput = gpu_check.run_step(by_name["throughput"], ctx, 150, tmp_path / "gpt.log")
    assert throughput["status"] == "passed", throughput
    rows = throughput["tables"][0]["rows"]
    assert [(row[0], row[1]) for row in rows] == [
        (method, compiled) for compiled in ("off", "eager")
        for method in ("torch_ddp", "td_ddp", "td_opt", "td_fsdp", "torch_fsdp")]
    assert all(row[4] == "-" for row in rows), "an MFU without a GPU's peak"
    assert len(throughput["targets"]) == 6 and all(
        isinstance(t["value"], float) and t["target"].startswith(">= 1.0") for t in throughput["targets"])
    assert throughput["numbers"]["flops_per_token"] > 0


def _probe_step(ctx: Context, log: str) -> Outcome:
    ctx.machine = {"torch": "2.x", "cuda": False, "modules": {}}
    return Outcome()


def _python(code: str):
    return lambda ctx: [[sys.executable, "-c", code]]


def test_a_failed_or_overrunning_step_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    pids = tmp_path / "pids"
    # The overrunning step starts a child of its own: both are gone once the budget is spent.
    overrun = ("import os, subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
               "time.sleep(60)\n")
    steps = (
        Step("environment", "probe", _python("pass"), 10, 10, read=_probe_step),
        Step("fails", "exits 3", _python("print('broken'); raise SystemExit(3)"), 10, 10),
        Step("overruns", "sleeps", _python(overrun), 3, 3),
        Step("needs-gpu", "GPU only", _python("pass"), 10, 10, needs_cuda=True),
        Step("missing", "needs a module", _python("pass"), 10, 10, needs=("nonexistent",)),
        Step("passes", "fine", _python("print('ok')"), 10, 10),
    )
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    code = gpu_check.check(tmp_path / "out", quick=True, only=None, deadline=60)
    assert code == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    status = {r["name"]: (r["status"], r["reason"]) for r in report["steps"]}
    assert status["fails"] == ("failed", "exit code 3")
    assert status["overruns"] == ("failed", "stopped at its budget of 3 s")
    assert status["needs-gpu"][0] == "skipped" and "needs a CUDA GPU" in status["needs-gpu"][1]
    assert status["missing"][0] == "skipped" and "needs nonexistent" in status["missing"][1]
    assert status["passes"] == ("passed", "")
    failed = {r["name"]: r for r in report["steps"]}["fails"]
    assert failed["log_tail"][-1] == "broken"
    for pid in map(int, pids.read_text().split()):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == report["summary"]
    assert printed[-1].startswith("gpu-check FAIL: 2 passed, 2 failed (fails, overruns), 2 skipped;")


def test_bad_arguments_are_named(capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main([])
    assert stopped.value.code == 2 and "give the folder for the report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--only", "cuda-tests,gpu"])
    assert "unknown step(s) ['gpu']" in capsys.readouterr().err
    (tmp_path / "report.json").write_text("{}")  # an earlier run's: its results must not be read
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--quick"])
    assert "already holds a report: give a new folder" in capsys.readouterr().err
    assert (tmp_path / "report.json").read_text() == "{}"


def test_vendor_brings_pytest_and_cloudpickle_for_a_machine_without_them(tmp_path):
    assert gpu_check.vendor(tmp_path / "deps") == 0
    # -S: no site-packages, so the imports can only come from the vendored folder.
    code = "import cloudpickle, pytest, pytest_timeout; print(pytest.__file__, cloudpickle.__file__)"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "deps")})
    assert done.returncode == 0, done.stderr
    assert all(path.startswith(str(tmp_path / "deps")) for path in done.stdout.split()), done.stdout
