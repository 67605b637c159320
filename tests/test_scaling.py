"""`tandem scale`: the step registry, the analysis (pure), and real scaling runs.

The runs use `tests/scripts/scale_train.py` (a small MLP on synthetic data) through the same
launcher as `tandem run`. Nothing here compares two timings: the tests check that the JSON is
self-consistent and that a two-rank step reports some communication. Which share of a step
dominates depends on the machine's load; `benchmarks/comm_vs_compute.py` measures that.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tandem.bench import plots, scaling
from tandem.cli.command import main
from tandem.diagnostics import steps
from tandem.job import settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "scale_train.py")


# --- the step registry (in this process) ----------------------------------------------------


@pytest.fixture
def fresh_steps():
    steps.reset()
    yield
    steps.reset()


def test_registry_splits_a_step_and_counts_loader_samples(fresh_steps):
    steps.step_done(0.0)  # the first step only starts the clock
    assert steps.records() == []
    steps.add_batch(0.001, 16)
    steps.add_batch(0.002, 16)  # two batches (gradient accumulation) in one step
    steps.step_done(0.004)
    steps.report(48)  # the script's own count wins from now on
    steps.add_batch(0.0, 16)
    steps.step_done(0.0)
    first, second = steps.records()
    assert first.samples == 32 and math.isclose(first.data_s, 0.003)
    assert first.comm_s == 0.004 and first.wall_s > 0
    assert math.isclose(first.compute_s, max(0.0, first.wall_s - 0.007))
    assert second.samples == 48 and second.data_s == 0.0


def test_registry_is_a_bounded_ring(fresh_steps):
    for i in range(steps.CAPACITY + 11):
        steps.report(i)
        steps.step_done(0.0)
    kept = steps.records()
    assert len(kept) == steps.CAPACITY
    assert kept[0].samples == 11 and kept[-1].samples == steps.CAPACITY + 10


def test_report_rejects_bad_counts(fresh_steps):
    with pytest.raises(TypeError, match="takes an int"):
        steps.report(3.5)
    with pytest.raises(ValueError, match="samples=-1"):
        steps.report(-1)


def test_weak_mode_scales_the_global_batch(monkeypatch):
    assert steps.scaled_batch(64, 4) == 64
    monkeypatch.setenv("TANDEM_SCALE_MODE", "weak")
    settings.reload()  # a process reads its settings once; this one changed them
    assert steps.scaled_batch(64, 4) == 256
    monkeypatch.setenv("TANDEM_SCALE_MODE", "fast")
    with pytest.raises(ValueError, match="TANDEM_SCALE_MODE='fast'"):
        settings.reload()


def test_scale_plan_writes_records_and_stops(fresh_steps, monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_SCALE_STEPS", "2")
    monkeypatch.setenv("TANDEM_SCALE_WARMUP", "1")
    monkeypatch.setenv("TANDEM_SCALE_OUT", str(tmp_path))
    settings.reload()
    steps.report(8)
    with pytest.raises(SystemExit) as stopped:
        for _ in range(10):
            steps.step_done(0.0)
    assert stopped.value.code == 0
    body = json.loads((tmp_path / "rank0.json").read_text())
    assert body["recorded"] == 3 and len(body["steps"]) == 3 and body["warmup"] == 1


# --- the analysis (pure) --------------------------------------------------------------------


def _rank_file(rank: int, walls, comm=0.01, data=0.002, samples=32, warmup=1) -> dict:
    return {"rank": rank, "warmup": warmup, "planned_steps": len(walls) - warmup,
            "steps": [{"wall_s": w, "comm_s": comm, "data_s": data, "samples": samples}
                      for w in walls]}


def test_summarize_takes_the_slowest_rank_and_sums_samples():
    row = scaling.summarize(2, [_rank_file(0, [9.0, 0.1, 0.1]), _rank_file(1, [9.0, 0.2, 0.1])],
                            warmup=1)
    assert row.measured_steps == 2
    assert math.isclose(row.step_s, 0.15)  # steps last max(0.1, 0.2) and 0.1
    assert row.global_batch == 64
    assert math.isclose(row.samples_per_s, 128 / 0.3)
    assert math.isclose(row.compute_s, 0.15 - 0.012)


def test_relate_and_table():
    rows = scaling.relate([
        scaling.summarize(2, [_rank_file(r, [1, 0.1, 0.1]) for r in (0, 1)], 1),
        scaling.summarize(1, [_rank_file(0, [1, 0.1, 0.1])], 1),
    ])
    assert [row.np for row in rows] == [1, 2]
    assert rows[1].speedup == pytest.approx(2.0) and rows[1].efficiency == pytest.approx(1.0)
    config = scaling.ScaleConfig(nps=(1, 2), program="train.py", backend="gloo")
    table = scaling.format_table(scaling.build_report(config, rows))
    assert "samples/s" in table and "2.00x" in table and "backend gloo" in table


def test_summarize_explains_missing_records():
    with pytest.raises(scaling.ScaleError, match="without a single optimizer step"):
        scaling.summarize(2, [], 1)
    with pytest.raises(scaling.ScaleError, match="ranks \\[0\\] only; expected 2"):
        scaling.summarize(2, [_rank_file(0, [1, 1])], 1)
    with pytest.raises(scaling.ScaleError, match="DistributedOptimizer"):
        scaling.summarize(1, [_rank_file(0, [1])], 1)
    with pytest.raises(scaling.ScaleError, match="td.metrics.report"):
        scaling.summarize(1, [_rank_file(0, [1, 1], samples=0)], 1)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="--np '1,x'"):
        scaling.parse_sizes("1,x")
    assert scaling.parse_sizes("4,1,2,2") == (1, 2, 4)
    with pytest.raises(ValueError, match="--mode 'fast'"):
        scaling.ScaleConfig(nps=(1,), program="t.py", mode="fast")
    with pytest.raises(ValueError, match="--steps 0"):
        scaling.ScaleConfig(nps=(1,), program="t.py", steps=0)


def test_plot_is_written_from_a_report(tmp_path):
    rows = scaling.relate([
        scaling.summarize(n, [_rank_file(r, [1, 0.1 * n, 0.1 * n]) for r in range(n)], 1)
        for n in (1, 2, 4)
    ])
    rows[-1].oversubscribed = True
    report = scaling.build_report(scaling.ScaleConfig(nps=(1, 2, 4), program="t.py"), rows)
    path = plots.plot_scaling(report, str(tmp_path / "scaling.png"))
    assert os.path.getsize(path) > 10_000
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_table_and_json_stay(tmp_path, monkeypatch):
    """A machine without matplotlib (a GPU box with its own torch) still gets the analysis."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(scaling, "measure", lambda config, n: scaling.summarize(
        n, [_rank_file(r, [1, 0.1 * n, 0.1 * n]) for r in range(n)], 1))
    said = []
    config = scaling.ScaleConfig(nps=(1, 2), program="t.py", backend="gloo", out=str(tmp_path))
    report = scaling.run(config, echo=said.append)
    assert [row["np"] for row in json.loads((tmp_path / "scaling.json").read_text())["rows"]] == [1, 2]
    assert [row["np"] for row in report["rows"]] == [1, 2] and not (tmp_path / "scaling.png").exists()
    assert "scaling.png not drawn" in said[-1] and "pip install matplotlib" in said[-1], said


# --- real runs --------------------------------------------------------------------------------


def _scale(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "scale"
    code = main(["scale", *args[:-1], "--out", str(out), *args[-1:]])
    assert code == 0
    return json.loads((out / "scaling.json").read_text())


@pytest.mark.timeout(240)
def test_scale_one_and_two_ranks(tmp_path):
    out = tmp_path / "scale"
    code = main(["scale", "--np", "1,2", "--steps", "5", "--warmup", "2", "--out", str(out),
                 SCRIPT, "--hidden", "64", "--batch", "64"])
    assert code == 0
    report = json.loads((out / "scaling.json").read_text())
    one, two = report["rows"]
    assert (one["np"], two["np"]) == (1, 2)
    for row in (one, two):
        assert row["measured_steps"] == 5
        assert row["global_batch"] == 64  # strong scaling: the global batch stays
        assert row["samples_per_s"] == pytest.approx(row["global_batch"] / row["step_s"], rel=1e-6)
        parts = row["compute_s"] + row["comm_s"] + row["data_s"]
        assert parts == pytest.approx(row["step_s"], rel=1e-6)
    assert one["speedup"] == 1.0 and one["comm_s"] == 0.0
    # Two ranks wait for each step's all-reduce: some of the step is communication, never all
    # of it (a lower bound only: which share dominates is timing, see
    # benchmarks/comm_vs_compute.py).
    assert 0.0 < two["comm_s"] <= two["step_s"], two
    per_rank = [json.loads((out / "np2" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for body in per_rank:
        measured = body["steps"][body["warmup"]:]
        assert len(measured) == 5 and all(s["comm_s"] > 0 for s in measured), body
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert os.path.getsize(out / "scaling.png") > 10_000
    assert sorted(os.listdir(out / "np2")) == ["rank0.json", "rank1.json"]


@pytest.mark.timeout(240)
def test_weak_mode_keeps_the_per_rank_batch(tmp_path):
    out = tmp_path / "weak"
    code = main(["scale", "--np", "1,2", "--mode", "weak", "--steps", "3", "--warmup", "1",
                 "--out", str(out), SCRIPT, "--hidden", "16", "--batch", "32"])
    assert code == 0
    one, two = json.loads((out / "scaling.json").read_text())["rows"]
    assert (one["global_batch"], two["global_batch"]) == (32, 64)


@pytest.mark.timeout(180)
def test_bench_allreduce_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "ar.json"
    # Three ranks: at two, the ring factor 2(n-1)/n is 1 and bus bandwidth = bytes / time.
    code = main(["bench", "allreduce", "-np", "3", "--backend", "gloo", "--sizes", "4K,64K",
                 "--budget", "0.05", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    sizes, n = [4096, 65536], 3
    assert (results["sizes"], results["np"]) == (sizes, n)
    variants = ["gloo_raw", "gloo_hot", "gloo_tandem", "gloo_tandem_checks"]
    assert sorted(results["time_us"]) == sorted(results["busbw_gbps"]) == sorted(variants)
    for name in variants:
        times = results["time_us"][name]
        assert len(times) == len(sizes) and all(t > 0 for t in times), (name, times)
        # Bus bandwidth of a ring all-reduce: each rank's link carries 2(n-1)/n of the bytes.
        expected = [2 * (n - 1) / n * size / (t * 1e-6) / 1e9
                    for size, t in zip(sizes, times, strict=True)]
        assert results["busbw_gbps"][name] == pytest.approx(expected, rel=1e-9), name
    times = results["time_us"]
    ratio = [t / r for t, r in zip(times["gloo_tandem"], times["gloo_raw"], strict=True)]
    assert results["ratios"]["gloo_tandem_over_raw_time"] == pytest.approx(ratio, rel=1e-9)
    # The table has both columns (time and bus bandwidth), one row per size, every variant.
    table = capsys.readouterr().out
    for title in ("median time per call (us)", "bus bandwidth (GB/s)"):
        header = next(line for line in table.splitlines() if line.startswith(title))
        assert all(label in header for label in ("Gloo raw", "td-Gloo hot", "td-Gloo+chk")), header
    rows = [line.split() for line in table.splitlines() if line.strip().startswith(("4 KB", "64 KB"))]
    assert len(rows) == 4 and all(len(row) == 2 + len(variants) for row in rows), rows
    for i, row in enumerate(rows[2:]):  # the bandwidth rows, as printed (3 decimals)
        printed = [float(v) for v in row[2:]]
        assert printed == pytest.approx([results["busbw_gbps"][v][i] for v in variants], abs=1e-3)
    assert os.path.getsize(out.with_suffix(".png")) > 10_000
