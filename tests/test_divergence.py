"""Ranks whose code paths diverge: one error on every rank naming each rank's operation,
never one rank's message read as another's data (MPI and Gloo match collectives by order).

Each check runs a short training loop in which rank 1 takes another path at step 2, catches
the error tandem raises, and returns it: both ranks must raise, at the same step, with a
message naming both ranks' operations. The right way to skip a step (`td.all_finite`) is
checked too: every rank skips it, and the replicas stay equal. Pipeline stages out of step are
named too: by the step's agreement (one stage evaluates, or logs with a collective, while the
others train); with checks off, by the step header or by the watchdog, which proves that the
stages wait for each other, long before the timeout. (Sharded and tensor-parallel models:
test_divergence_sharded.py.)
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem as td
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    pytest.importorskip("importlib").util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _run(path: str, wrapper: str, compiled: bool = False):
    """Train 5 steps; rank 1 takes `path` at step 2. Returns (step, error) or (None, weights)."""
    rank = td.rank()
    model = _model()
    if wrapper == "ddp":
        model = td.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        td.broadcast_parameters(model)
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    forward = torch.compile(model) if compiled else model
    step = -1
    try:
        for step in range(5):
            x = torch.full((3, 4), float(rank + step + 1))
            loss = forward(x).pow(2).mean()
            if path == "nan" and rank == 1 and step == 2:
                loss = loss * float("nan")
            if path == "nan":
                if not td.all_finite(loss):
                    continue  # the right way: every rank skips together
            elif rank == 1 and step == 2:
                if path == "skip":  # the wrong way: this rank alone skips
                    continue
                if path == "broadcast":
                    td.broadcast(torch.zeros(3))
                    continue
            opt.zero_grad()
            loss.backward()
            if path == "skip_step" and rank == 1 and step == 2:
                continue  # reduced, but not stepped: this replica would drift
            opt.step()
        td.barrier()
    except td.CollectiveMismatchError as error:
        return step, type(error).__name__, str(error)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return None, None, weights


def _start(broadcast: bool):
    """Two steps of DistributedOptimizer from rank-dependent weights; the warnings raised."""
    import warnings

    torch.manual_seed(td.rank())
    model = nn.Linear(4, 2)
    if broadcast:
        td.broadcast_parameters(model)
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    return [str(w.message) for w in caught if w.category is td.errors.ReplicaStartWarning]


def _layout_meets_barrier():
    """Agreements of different kinds (a layout, a barrier's check) meet: one error, both named."""
    from tandem.comm.agreement import agree as agreement

    try:
        if td.rank() == 0:
            agreement.agree_layout("my model", ["w (3,) float32"])
        else:
            td.barrier()
    except td.DivergedError as error:
        return str(error)
    return None


def check_divergence(wrapper):
    results = {"start": (_start(False), _start(True)), "kinds": _layout_meets_barrier()}
    for path in ("broadcast", "skip", "skip_step", "nan"):
        results[path] = _run(path, wrapper)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_diverged_ranks_are_named_and_skipping_together_works(backend):
    for wrapper in ("ddp", "optimizer"):
        ranks = run_distributed(check_divergence, 2, backend, args=(wrapper,), timeout=120)
        for path in ("broadcast", "skip", "skip_step"):
            first, second = ranks[0][path], ranks[1][path]
            if wrapper == "ddp" and path == "skip_step":
                continue  # a plain torch optimizer's steps are not tandem's to count
            if wrapper == "optimizer" and path == "skip":
                # Forward is not seen by DistributedOptimizer: caught at the barrier after the loop.
                assert first[0] == 4 and second[0] == 4, (path, first, second)
            else:
                assert {first[0], second[0]} <= {2, 3}, (wrapper, path, first, second)
            for _, kind, message in (first, second):
                assert kind == "DivergedError", (wrapper, path, message)
                assert "rank 0:" in message and "rank 1:" in message, message
                assert "td.all_finite" in message, message
            if path == "broadcast":
                assert "broadcast(shape=(3,)" in first[2] and "gradient reduction" in first[2]
            if path == "skip_step" and wrapper == "optimizer":
                assert "after 3 optimizer steps" in first[2] and "after 2 optimizer" in first[2]
        for rank in ranks:
            assert "rank 0: w (3,) float32" in rank["kinds"], rank["kinds"]
            assert "rank 1: barrier()" in rank["kinds"], rank["kinds"]
        (different, same), (other, _) = ranks[0]["start"], ranks[1]["start"]
        assert len(different) == 1 and "td.broadcast_parameters(model)" in different[0]
        assert same == [] and other == []  # once, on the group's first rank; none when equal
        (s0, _, w0), (s1, _, w1) = ranks[0]["nan"], ranks[1]["nan"]
        assert s0 is None and s1 is None
        assert w0 == w1 and torch.isfinite(torch.tensor(w0)).all()


def check_compiled_skips(wrapper):
    return {path: _run(path, wrapper, compiled=True) for path in ("skip", "skip_step")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_skips_a_compiled_step_is_named(backend):
    """Compiled, the backward is cut at the buckets under both wrappers (docs/compile.md): a
    rank that skips a step, or only its optimizer step, is still named, never waited for."""
    for wrapper in ("ddp", "optimizer"):
        ranks = run_distributed(check_compiled_skips, 2, backend, args=(wrapper,), timeout=180)
        # A plain torch optimizer's steps (under the DDP wrapper) are not tandem's to count.
        for path in ("skip",) if wrapper == "ddp" else ("skip", "skip_step"):
            for step, kind, message in (ranks[0][path], ranks[1][path]):
                assert kind == "DivergedError", (wrapper, path, step, message)
                assert "rank 0:" in message and "rank 1:" in message, message


def test_a_rank_inside_a_tandem_call_is_not_reported_as_computing():
    """The watchdog's words for a rank whose stack is in tandem but in no counted wait."""
    from tandem.comm.watchdog import waitgraph

    answer = {"state": "running", "waits": [], "issued": {"world": 4},
              "inside": "td.allreduce (called at train.py:31)"}
    said = waitgraph.state_of(1, answer, "world")
    assert said.startswith("inside td.allreduce (called at train.py:31)"), said
    assert "computing" not in said
    assert "computing" in waitgraph.state_of(1, dict(answer, inside=None), "world")


PIPELINE_SCRIPT = Path(__file__).parent / "scripts" / "pipeline_out_of_step.py"


def _pipeline_job(mode: str, backend: str, checks: str = "1") -> subprocess.CompletedProcess:
    """The script under `tandem run -np 2` with a 10-minute TANDEM_TIMEOUT: a job that ends
    within the subprocess's 120 s was stopped by a proof or a check, not by the timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(TANDEM_TIMEOUT="600", TANDEM_CHECKS=checks, PYTHONPATH=str(Path(td.__file__).parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", "2", "--backend", backend,
         str(PIPELINE_SCRIPT), mode], env=env, capture_output=True, text=True, timeout=120)


def pipeline_out_of_step(mode: str):
    """tests/scripts/pipeline_out_of_step.py's loop with checks on, on this rank of a shared
    world: rank 1 (the last stage) logs with td.allreduce ("collective") or evaluates ("eval")
    at step 2 while stage 0 trains. The step's agreement raises on every rank before anything
    is sent, so the world goes on; (step, error type, message), or (None, "finished", "")."""
    torch.manual_seed(0)
    pipe = td.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(5):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        try:
            if step == 2 and td.rank() == 1:
                if mode == "collective":
                    td.allreduce(torch.ones(1))
                else:
                    pipe(x)
                continue
            pipe.train_step(x, y, nn.functional.mse_loss)
        except td.DivergedError as error:
            return step, type(error).__name__, str(error)
        opt.step()
        opt.zero_grad()
    return None, "finished", ""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stage_in_a_collective_while_the_others_train_is_named_by_the_step_agreement(backend):
    """In a shared world (the step's agreement raises on every rank; the job-level ends, with
    checks off, are the jobs below)."""
    for rank, (step, kind, message) in enumerate(
            run_distributed(pipeline_out_of_step, 2, backend, args=("collective",))):
        assert (step, kind) == (2, "DivergedError"), (rank, step, kind, message)
        assert "ranks are in different operations" in message, (rank, message)
        assert "rank 0: Pipeline train_step #3 of Sequential, stage 0 (after 2 optimizer steps)" \
            in message, (rank, message)
        assert "rank 1: allreduce(shape=(1,), dtype=float32" in message, (rank, message)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_stages_out_of_step_are_named_long_before_the_timeout(backend):
    """With checks off: the last stage logs with a collective while stage 0 trains, and each
    waits for the other. Outside debug mode too, the watchdog proves the cycle and names both
    ranks' operations."""
    done = _pipeline_job("collective", backend, checks="0")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "finished" not in output, output
    assert "desync: these ranks wait for each other" in output, output
    assert re.search(r"rank 0: recv #\d+ from rank 1 .*pipeline_out_of_step.py:\d+", output), output
    assert re.search(r"rank 1: allreduce #\d+ .*td.allreduce at pipeline_out_of_step.py:\d+",
                     output), output


def test_a_stage_that_evaluates_while_stage_0_trains_is_named_by_the_step_agreement():
    """Checks on, in a shared world: the step's agreement."""
    for rank, (step, kind, message) in enumerate(
            run_distributed(pipeline_out_of_step, 2, "gloo", args=("eval",))):
        assert (step, kind) == (2, "DivergedError"), (rank, step, kind, message)
        assert "rank 0: Pipeline train_step #3 of Sequential, stage 0" in message, (rank, message)
        assert "rank 1: Pipeline forward #1 of Sequential, stage 1" in message, (rank, message)


@pytest.mark.timeout(300)
def test_a_stage_that_evaluates_while_stage_0_trains_raises_diverged_error():
    """Checks off, a job: the step header, which stage 0 sends down the pipeline, names the
    calls on stage 1, which raises and ends the job (stage 0 would wait for it)."""
    done = _pipeline_job("eval", "gloo", "0")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "finished" not in output, output
    assert ("DivergedError: pipeline stages are in different calls: stage 0 (rank 0) runs "
            "train_step, stage 1 (rank 1) runs forward (evaluation)") in output, output
