"""A preemption signal is a step boundary every rank agrees on (issue 44, items 1 and 4).

A real SIGUSR1 to one rank mid-epoch: the reducer's per-step agreement carries it, every rank's
`Checkpointer.save` saves after the same step and raises `Preempted` (exit status 75), and a
restart on another number of ranks ends as one uninterrupted process. Without a reducer, the
save's own agreement carries it. A signal before the first step and a second signal end the
process at once with status 75 (real processes; the previous checkpoint stands).
"""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_data_resume import BATCH, EPOCHS, SEED, dataset, mlp, one_process

import tandem as td
from tandem.checkpoint.preemption import preempted
from tandem.job import preemption
from tandem.job.preemption import EXIT_PREEMPTED, Preempted
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]


def train(directory, signal_at=None, signalled_rank=1):
    """Train (from the newest checkpoint) with a Checkpointer that saves every 1000 steps; at
    global step `signal_at`, rank `signalled_rank` sends itself SIGUSR1 before its backward.
    Returns ("preempted", step, exit code, checkpoints) or ("done", difference from one process)."""
    try:
        model = mlp()
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        loader, _ = td.partition_dataset(dataset(), batch_size=BATCH, seed=SEED, pad=False)
        checkpointer = td.Checkpointer(directory, every=1000, keep=1)
        step = checkpointer.restore(model=model, optimizer=opt, data=loader)
        while loader.epoch < EPOCHS:
            for xb, yb, _ in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                if step == signal_at and td.rank() == signalled_rank:
                    os.kill(os.getpid(), signal.SIGUSR1)
                loss.backward()
                opt.step()
                try:
                    checkpointer.save(step, model=model, optimizer=opt, data=loader)
                except Preempted as stop:
                    return "preempted", stop.step, stop.code, checkpointer.checkpoints()
                step += 1
        reference = one_process()
        return "done", max((a - b).abs().max().item() for a, b in zip(
            model.state_dict().values(), reference.state_dict().values(), strict=True))
    finally:
        preemption.disarm()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_and_resumes(tmp_path, backend):
    directory = str(tmp_path / "ck")
    stopped = run_distributed(train, 3, backend, args=(directory, 5), timeout=150)
    # Every rank saved after the step in which rank 1 heard the signal, and exits with 75.
    assert stopped == [("preempted", 5, EXIT_PREEMPTED, [6])] * 3
    resumed = run_distributed(train, 2, backend, args=(directory,), timeout=150)
    for kind, difference in resumed:
        assert kind == "done" and difference < 1e-6


def check_without_reducer(signal_at):
    """No reducer: td.preempted()'s own agreement carries rank 0's signal."""
    try:
        steps = []
        for step in range(10):
            if step == signal_at and td.rank() == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            if preempted():
                steps.append(step)
                break
        return steps, preemption.heard()
    finally:
        preemption.disarm()


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_reducer_the_stop_is_agreed_at_the_boundary(backend):
    results = run_distributed(check_without_reducer, 2, backend, args=(4,))
    assert [steps for steps, _ in results] == [[4], [4]]
    assert [heard for _, heard in results] == ["SIGTERM", None]


_STARTUP = """
import os, signal, sys
import tandem as td
from tandem.checkpoint.preemption import preempted
ckpt = td.Checkpointer(sys.argv[1])            # arms the handler
os.kill(os.getpid(), signal.SIGTERM)           # before the first step: nothing to save
print("not reached")
"""

_SECOND = """
import os, signal, sys
import torch
import tandem as td
ckpt = td.Checkpointer(sys.argv[1])
model = torch.nn.Linear(2, 2)
ckpt.save(0, model=model)                      # a boundary, and the checkpoint that stands
os.kill(os.getpid(), signal.SIGUSR1)           # noted: the next boundary would save
os.kill(os.getpid(), signal.SIGTERM)           # the second: stop now
print("not reached")
"""


@pytest.mark.parametrize("script, said", [
    (_STARTUP, "during start-up, before the first step"),
    (_SECOND, "SIGTERM after SIGUSR1: stopping now"),
])
def test_a_signal_before_the_first_step_or_a_second_signal_exits_at_once(tmp_path, script, said):
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert said in done.stderr and "not reached" not in done.stdout
    if script is _SECOND:
        assert td.Checkpointer(tmp_path).checkpoints() == [1]  # the previous checkpoint stands


def test_the_signals_and_the_walltime_are_read_from_the_environment():
    assert preemption.signal_numbers("USR2, TERM") == (signal.SIGUSR2, signal.SIGTERM)
    with pytest.raises(ValueError, match="TANDEM_PREEMPT_SIGNALS='KILL'.*choose from"):
        preemption.signal_numbers("KILL")
    assert preemption.deadline_of({"SLURM_JOB_END_TIME": "1000"}, now=0) == 880
    assert preemption.deadline_of({"TANDEM_TIME_LIMIT": "600", "TANDEM_PREEMPT_LEAD": "60"},
                                  now=100) == 640
    assert preemption.deadline_of({}, now=0) is None
