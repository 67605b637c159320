"""Preemption: seconds from the signal to the saved checkpoint and to the exit, and the step
time with the handler armed against without. Prints a table and writes results/preemption.json.

    python benchmarks/preemption.py            # one process (the per-step cost is the flag read)
    tandem run -np 2 benchmarks/preemption.py  # the agreed stop over ranks
"""

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tandem as td
from tandem.checkpoint.preemption import preempted
from tandem.job import preemption
from tandem.job.preemption import Preempted

STEPS = 200


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    return model, opt, x, y


def step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def step_time(armed: bool) -> float:
    model, opt, x, y = setup()
    for _ in range(20):
        step(model, opt, x, y)
    start = time.perf_counter()
    for _ in range(STEPS):
        step(model, opt, x, y)
        if armed:
            preempted()
    elapsed = (time.perf_counter() - start) / STEPS
    preemption.disarm()
    return elapsed


def signal_to_exit(directory: str) -> tuple[float, float]:
    model, opt, x, y = setup()
    ckpt = td.Checkpointer(directory, every=1000, keep=1)
    sent = saved = None
    try:
        for i in range(10_000):
            step(model, opt, x, y)
            if i == 5 and td.rank() == 0:
                sent = time.perf_counter()
                os.kill(os.getpid(), signal.SIGUSR1)
            try:
                ckpt.save(i, model=model, optimizer=opt)
            except Preempted:
                saved = time.perf_counter()
                break
    finally:
        preemption.disarm()
    sent = td.broadcast_object(sent, root=0) if td.size() > 1 else sent
    exited = time.perf_counter()  # what is left after the save is the exit itself
    return saved - sent, exited - sent


def main():
    td.init()
    plain, armed = step_time(False), step_time(True)
    with tempfile.TemporaryDirectory() as tmp:
        to_save, to_exit = signal_to_exit(td.broadcast_object(tmp, root=0) if td.size() > 1 else tmp)
    result = {"world_size": td.size(), "step_s": plain, "step_armed_s": armed,
              "armed_cost": armed / plain - 1, "signal_to_saved_s": to_save,
              "signal_to_exit_s": to_exit}
    if td.rank() == 0:
        print(f"{'ranks':>5} {'step (ms)':>10} {'armed (ms)':>11} {'cost':>7} {'to saved (s)':>13} "
              f"{'to exit (s)':>12}")
        print(f"{td.size():>5} {plain * 1e3:>10.3f} {armed * 1e3:>11.3f} {result['armed_cost']:>+7.1%} "
              f"{to_save:>13.3f} {to_exit:>12.3f}")
        out = Path("results") / "preemption.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    td.shutdown()


if __name__ == "__main__":
    main()
