"""Preemption: the step time with the handler armed against without, and seconds from the signal
to the saved checkpoint and to the exit. Prints a table and writes results/preemption.json.

    python benchmarks/preemption.py            # one process (the per-step cost is the flag read)
    tandem run -np 2 benchmarks/preemption.py  # the agreed stop over ranks (the flag rides on
                                               # the reducer's per-step agreement)
    ... --reps 9 --steps 200

The armed cost is measured as a ratio in one run: REPS repetitions, each timing STEPS steps not
armed and STEPS steps armed (`td.preempted()` after each step, what `Checkpointer.save` asks), in
alternating order, on the same model. The same is done for two unarmed runs (A/A): the spread
of that ratio is the noise floor, so "no measurable cost" reads as an armed ratio inside it.
"""

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tandem as td
from tandem.checkpoint.preemption import preempted
from tandem.job import preemption
from tandem.job.preemption import Preempted


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


def timed(armed: bool, steps: int, model, opt, x, y) -> float:
    """Seconds per step over `steps` steps, armed (td.preempted() after each) or not."""
    if armed:
        preemption.arm()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x, y)
        if armed:
            preempted()
    elapsed = (time.perf_counter() - start) / steps
    preemption.disarm()
    return elapsed


def armed_cost(reps: int, steps: int) -> dict:
    """Per repetition: plain, armed and a second plain timing (orders alternate), their
    ratios armed/plain and plain/plain (the noise floor)."""
    model, opt, x, y = setup()
    for _ in range(20):
        step(model, opt, x, y)
    plain, armed, again = [], [], []
    for rep in range(reps):
        order = (False, True, False) if rep % 2 == 0 else (True, False, False)
        times: dict[bool, list[float]] = {True: [], False: []}
        for kind in order:
            times[kind].append(timed(kind, steps, model, opt, x, y))
        armed.append(times[True][0])
        plain.append(times[False][0])
        again.append(times[False][1])
    ratios = [a / p for a, p in zip(armed, plain, strict=True)]
    floor = [b / p for b, p in zip(again, plain, strict=True)]
    return {"reps": reps, "steps": steps, "step_s": plain, "step_armed_s": armed,
            "step_again_s": again, "armed_ratio": ratios, "noise_ratio": floor,
            "armed_ratio_median": statistics.median(ratios),
            "noise_ratio_median": statistics.median(floor)}


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    td.init()
    cost = armed_cost(args.reps, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        to_save, to_exit = signal_to_exit(td.broadcast_object(tmp, root=0) if td.size() > 1 else tmp)
    result = {"world_size": td.size(), **cost, "signal_to_saved_s": to_save,
              "signal_to_exit_s": to_exit}
    if td.rank() == 0:
        print(f"ranks {td.size()}, {args.reps} repetitions of {args.steps} steps each way, "
              f"alternating order")
        print(f"{'rep':>4} {'plain (ms)':>11} {'armed (ms)':>11} {'plain again':>12} "
              f"{'armed/plain':>12} {'again/plain':>12}")
        for rep in range(args.reps):
            print(f"{rep:>4} {cost['step_s'][rep] * 1e3:>11.3f} {cost['step_armed_s'][rep] * 1e3:>11.3f} "
                  f"{cost['step_again_s'][rep] * 1e3:>12.3f} {cost['armed_ratio'][rep]:>12.3f} "
                  f"{cost['noise_ratio'][rep]:>12.3f}")
        spread = (min(cost["noise_ratio"]), max(cost["noise_ratio"]))
        print(f"median armed/plain {cost['armed_ratio_median']:.3f}; noise floor (plain/plain) "
              f"median {cost['noise_ratio_median']:.3f}, range {spread[0]:.3f}-{spread[1]:.3f}")
        print(f"signal -> saved {to_save:.3f} s, signal -> exit {to_exit:.3f} s")
        out = Path("results") / "preemption.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))
    td.shutdown()


if __name__ == "__main__":
    main()
