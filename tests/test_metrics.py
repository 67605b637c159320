"""td.MetricLogger, td.Average and td.progress on a real 2-rank world.

One world checks the logger (averages over ranks, CSV and TensorBoard files on rank 0 only,
bad input) and the bar (rank 0 only, plain lines into a pipe); the parent reads the event
file back with TensorBoard's own reader and the CSV file with `csv`.
"""

import csv
import io
import math
import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import tandem as td
from tandem import runtime
from tandem.testing import run_distributed


def _raises(error_type, call, *fragments):
    try:
        call()
    except error_type as error:
        missing = [f for f in fragments if f not in str(error)]
        assert not missing, f"{error!r} lacks {missing}"
        return str(error)
    raise AssertionError(f"{call} did not raise {error_type.__name__}")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def check_logger_and_progress(tmp):
    rank = td.rank()
    log_dir = os.path.join(tmp, f"run-of-rank{rank}")  # rank 1 must create nothing
    logger = td.metrics.MetricLogger(log_dir)
    first = logger.log(0, loss=1.0 + rank, accuracy=torch.tensor(0.5 * rank))
    assert first == {"accuracy": 0.25, "loss": 1.5}
    second = logger.log(10, loss=torch.tensor([3.0]), lr=0.1 * (rank + 1))  # lr: a new column

    # a few real data-parallel steps, then their timing in the same reduction
    model = nn.Linear(4, 2)
    td.broadcast_parameters(model)
    optimizer = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for _ in range(4):
        td.metrics.report(samples=8)
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    timed = logger.log(20, loss=0.5, timing=True)
    assert timed["samples_per_s"] > 0 and timed["time/compute_s"] >= 0, timed
    assert set(timed) == {"loss", "samples_per_s", "time/compute_s", "time/comm_s", "time/data_s"}

    _raises(TypeError, lambda: logger.log(30, loss="0.3"), "loss='0.3'", "not a number", "loss.item()")
    _raises(TypeError, lambda: logger.log(30, loss=torch.ones(3)), "loss=", "not a number")
    _raises(TypeError, lambda: logger.log(1.5, loss=1.0), "step=1.5", "int")
    logger.close()

    # unwritable on rank 0 (a directory under a file): every rank fails at construction
    blocker = os.path.join(tmp, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    td.barrier()
    bad = os.path.join(blocker, "logs") if rank == 0 else os.path.join(tmp, "fine")
    _raises(PermissionError, lambda: td.metrics.MetricLogger(bad), os.path.join(blocker, "logs"),
            "cannot write")

    # progress: a bar on rank 0 only; into a pipe plain lines, on a terminal redrawn in place
    piped, terminal = io.StringIO(), _Terminal()
    bar = td.metrics.progress(range(5), file=piped, desc="pipe", mininterval=0, delay=0)
    assert list(bar) == list(range(5))
    list(td.metrics.progress(range(5), file=terminal, desc="tty", mininterval=0))
    return second, piped.getvalue(), terminal.getvalue(), sorted(os.listdir(tmp))


def test_metric_logger_and_progress(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'tandem[tensorboard]'")
    (second, pipe0, tty0, files), (_, pipe1, tty1, _) = run_distributed(
        check_logger_and_progress, world_size=2, args=(str(tmp_path),))
    assert second == {"loss": 3.0, "lr": pytest.approx(0.15)}
    assert "run-of-rank0" in files and "run-of-rank1" not in files and "fine" not in files

    with open(tmp_path / "run-of-rank0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "10", "20"]
    assert float(rows[0]["loss"]) == 1.5 and rows[0]["lr"] == ""
    assert float(rows[1]["lr"]) == pytest.approx(0.15)
    assert float(rows[2]["samples_per_s"]) > 0 and rows[2]["time/comm_s"] != ""

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run-of-rank0"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 1.5), (10, 3.0), (20, 0.5)]
    assert {"accuracy", "lr", "samples_per_s", "time/compute_s"} <= set(events.Tags()["scalars"])

    assert pipe1 == "" and tty1 == ""  # no bar on rank 1
    assert "\r" not in pipe0 and "pipe: 100%" in pipe0 and pipe0.endswith("\n"), repr(pipe0)
    assert "\r" in tty0 and "tty: 100%" in tty0, repr(tty0)


def _issued() -> int:
    """Operations this rank has issued so far (the watchdog counts every one)."""
    return sum(runtime.get_backend().watchdog._issued.values())


def _measured(call):
    before = _issued()
    result = call()
    return result, _issued() - before


def check_names_agree(tmp):
    rank, out = td.rank(), {}
    logger = td.metrics.MetricLogger(os.path.join(tmp, "agree"), tensorboard=False)
    # The user's trial: same number of names, different names. A plain sum wrote loss = 50.5.
    theirs = {"loss": 1.0} if rank == 0 else {"acc": 100.0}
    out["swapped"] = _raises(td.metrics.MetricMismatchError, lambda: logger.log(0, **theirs),
                             "MetricLogger.log: the ranks passed different metric names",
                             "rank 0: MetricLogger.log(loss)", "rank 1: MetricLogger.log(acc)",
                             "'acc' (only on rank 1), 'loss' (only on rank 0)", "same names")
    # Different numbers of names: named the same way, not "pass the same shape".
    more = {"loss": 1.0, "acc": 0.5} if rank == 0 else {"loss": 1.0}
    out["count"] = _raises(td.metrics.MetricMismatchError, lambda: logger.log(0, **more),
                           "rank 0: MetricLogger.log(acc, loss)", "rank 1: MetricLogger.log(loss)",
                           "'acc' (only on rank 0)")
    out["logger_silent"] = _raises(td.metrics.MetricMismatchError,
                                   lambda: logger.log(0, **({"loss": 1.0} if rank else {})),
                                   "rank 0: MetricLogger.log with no names")
    # Nothing was written or lost: the logger goes on, in two messages as before.
    out["logged"], out["logged_ops"] = _measured(lambda: logger.log(1, loss=1.0 + rank))
    logger.close()

    # Average: a rank without samples (no update at all, or update(0, ...)) counts for nothing.
    for how in ("none", "zero"):
        average = td.metrics.Average()
        if rank == 1:
            average.update(4, loss=2.0, accuracy=torch.tensor(0.5))
            average.update(4, loss=4.0, accuracy=1.0)
        elif how == "zero":
            average.update(0, loss=123.0, accuracy=7.0)
        out[f"empty_{how}"], out[f"empty_{how}_ops"] = _measured(average.compute)
    out["no_names"] = td.metrics.Average().compute()
    nobody = td.metrics.Average()
    nobody.update(0, loss=1.0)
    out["no_samples"] = nobody.compute()
    uneven = td.metrics.Average()
    uneven.update(1 + 3 * rank, loss=float(rank))  # 1 sample of 0.0, 4 samples of 1.0
    out["uneven"], out["uneven_ops"] = _measured(uneven.compute)

    differ = td.metrics.Average()
    differ.update(2, **({"loss": 1.0} if rank == 0 else {"acc": 1.0}))
    out["average"] = _raises(td.metrics.MetricMismatchError, differ.compute,
                             "Average.compute: the ranks passed different metric names",
                             "rank 0: Average.compute(loss)", "rank 1: Average.compute(acc)",
                             "'acc' (only on rank 1), 'loss' (only on rank 0)", "update(0, ...)")
    # Different calls meet, and say so; another operation altogether is a DivergedError.
    logger = td.metrics.MetricLogger(os.path.join(tmp, "agree"), tensorboard=False)
    same = td.metrics.Average()
    same.update(1, loss=1.0)
    out["calls"] = _raises(td.metrics.MetricMismatchError, lambda: logger.log(2, loss=1.0) if rank == 0
                           else same.compute(), "ranks are in different metric reductions",
                           "rank 0: MetricLogger.log(loss)", "rank 1: Average.compute(loss)")
    out["diverged"] = _raises(td.DivergedError, lambda: logger.log(2, loss=1.0) if rank == 0
                              else td.allreduce(torch.ones(3)), "MetricLogger.log", "rank 1")
    out["after"] = logger.log(3, loss=float(rank))
    logger.close()

    # progress(disable=...): the user's switch on top of rank 0's.
    bars = {}
    for disable in (True, False, None):
        for kind, stream in (("pipe", io.StringIO()), ("tty", _Terminal())):
            list(td.metrics.progress(range(3), file=stream, desc="bar", disable=disable, mininterval=0,
                             delay=0, dynamic_ncols=False))
            bars[f"{disable}-{kind}"] = "bar: 100%" in stream.getvalue()
    out["bars"] = bars
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_metric_names_agree_and_empty_ranks_count_for_nothing(tmp_path, backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    results = run_distributed(check_names_agree, world_size=2, backend=backend, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        assert out["logged"] == {"loss": 1.5} and out["after"] == {"loss": 0.5}, out
        assert out["empty_none"] == out["empty_zero"] == {"accuracy": 0.75, "loss": 3.0}, out
        assert out["uneven"] == {"loss": 0.8}, out
        assert out["no_names"] == {} and math.isnan(out["no_samples"]["loss"]), out
        # The agreement takes the place of the all-reduce's own check: 2 messages, as before.
        assert out["logged_ops"] == out["uneven_ops"] == 2, out
        assert out["empty_zero_ops"] == 2 and out["empty_none_ops"] == 4, out  # + who has names
        expected = {"True-pipe": False, "True-tty": False, "False-pipe": rank == 0,
                    "False-tty": rank == 0, "None-pipe": False, "None-tty": rank == 0}
        assert out["bars"] == expected, (rank, out["bars"])
    assert results[0]["swapped"] == results[1]["swapped"]  # one message, on every rank
    with open(tmp_path / "agree" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], float(r["loss"])) for r in rows] == [("1", 1.5), ("3", 0.5)], rows  # no 50.5


def check_three_ranks(tmp):
    """Rank 0 without samples; ranks 1 and 2 agree, then disagree; the logger names ranks."""
    rank, out = td.rank(), {}
    names = [{}, {"loss": 1.0}, {"loss": 3.0}]
    average = td.metrics.Average()
    if names[rank]:
        average.update(2, **names[rank])
    out["agree"] = average.compute()
    names = [{}, {"loss": 1.0}, {"acc": 3.0}]
    average = td.metrics.Average()
    if names[rank]:
        average.update(2, **names[rank])
    out["differ"] = _raises(td.metrics.MetricMismatchError, average.compute,
                            "rank 0: Average.compute with no names (no samples",
                            "rank 1: Average.compute(loss)", "rank 2: Average.compute(acc)",
                            "'acc' (only on rank 2), 'loss' (only on rank 1)")
    logger = td.metrics.MetricLogger(os.path.join(tmp, "three"), tensorboard=False)
    out["logger"] = _raises(td.metrics.MetricMismatchError,
                            lambda: logger.log(0, **({"acc": 1.0} if rank == 1 else {"loss": 1.0})),
                            "'acc' (only on rank 1), 'loss' (only on ranks 0, 2)")
    logger.close()
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_metric_names_on_three_ranks_one_without_samples(tmp_path, backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    results = run_distributed(check_three_ranks, world_size=3, backend=backend, args=(str(tmp_path),))
    assert all(out["agree"] == {"loss": 2.0} for out in results), results
    assert len({out["differ"] for out in results}) == 1, results  # the same error on every rank


def test_metric_logger_without_tensorboard_writes_csv(tmp_path):
    """One process, no job: `tensorboard=False` writes the CSV file only."""
    with td.metrics.MetricLogger(tmp_path, tensorboard=False) as logger:
        assert logger.log(3, loss=2) == {"loss": 2.0}
    assert os.listdir(tmp_path) == ["metrics.csv"]
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [r["loss"] for r in csv.DictReader(f)] == ["2.0"]


BAR_SCRIPT = """
import os, tandem as td
td.init()
gate = open(os.environ["BAR_GATE"]) if td.rank() == 0 and "BAR_GATE" in os.environ else None
for step in td.progress(range(4), desc="bar", mininterval=0, delay=0):
    if step == 1 and gate is not None:
        gate.read()  # ends when the test has seen the bar drawn in place
    td.barrier()
print("done", td.rank())
td.shutdown()
"""
DRAWN_IN_PLACE = b"\r\x1b[K[0] bar:"


def _tandem_run(script, *flags, terminal, gate=None):
    """`tandem run -np 2 script` with its stdout and stderr on a pseudo-terminal or a pipe.

    `gate`: a FIFO that rank 0 reads to its end after its bar's first draw; we hold its only
    writing end and close it (which lets rank 0 go on) once the terminal has shown that draw.
    Without it a loaded machine can deliver the whole bar in one read, and the agent rightly
    prints just the last state. The first draw the terminal shows may itself be two states
    that arrived together (0/4 and 1/4, printed as the last one, not in place); every later
    one comes after the gate, so it is drawn in place.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    if gate is not None:
        os.mkfifo(gate)
        env["BAR_GATE"] = str(gate)
        gate = os.open(gate, os.O_RDWR)  # never blocks; rank 0's read ends when we close it
    command = [sys.executable, "-m", "tandem", "run", "-np", "2", *flags, str(script)]
    if not terminal:
        done = subprocess.run(command, env=env, capture_output=True, timeout=120)
        return done.returncode, done.stdout + done.stderr
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=follower,
                               stderr=follower)
    os.close(follower)
    output, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
                if gate is not None and b"[0] bar:" in output:
                    os.close(gate)
                    gate = None
        else:
            raise AssertionError(f"tandem run did not finish in 120 s; output so far: {output!r}")
        return process.wait(timeout=30), output
    finally:
        os.close(leader)
        if gate is not None:
            os.close(gate)
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("backend", ["gloo", "default"])
def test_rank0_bar_redraws_in_place_under_tandem_run_on_a_terminal(tmp_path, backend):
    script = tmp_path / "bar.py"
    script.write_text(BAR_SCRIPT)
    flags = ("--backend", "gloo") if backend == "gloo" else ()
    code, output = _tandem_run(script, *flags, terminal=True, gate=tmp_path / "gate")
    assert code == 0, output
    assert DRAWN_IN_PLACE in output, output  # drawn in place, prefixed
    assert b"[0] bar: 100%" in output and b"[1] bar" not in output, output
    assert b"[0] done 0" in output and b"[1] done 1" in output, output
    if backend == "gloo":  # into a pipe the same job writes plain lines
        code, output = _tandem_run(script, *flags, terminal=False)
        assert code == 0, output
        assert b"\r" not in output and b"[0] bar: 100%" in output and b"[1] bar" not in output, output
