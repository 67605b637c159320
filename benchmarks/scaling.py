"""What the scaling and timeline instrumentation costs: per call, and per training step.

    python benchmarks/scaling.py                  # prints a table, writes results/instrumentation.json
    python benchmarks/scaling.py --calls 200000 --steps 100 --out /tmp/x.json

1. Per call (ns), 1e6 calls each: the `if timeline.ENABLED:` test hot paths make when the
   timeline is off, `timeline.span()` off and on, and `steps.step_done()` (what every
   optimizer step pays so that `tandem scale` can read it), next to an empty loop.
2. Per step, one process: a small MLP trained with a plain torch optimizer (the reference),
   with `td.DistributedOptimizer` (world of one: no communication, the step registry on),
   and the same with the timeline recording. Reported as ratios to the reference.

For the scaling analysis itself run `tandem scale` (see docs/scaling.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from tandem.bench.results import write_json
from tandem.diagnostics import steps, timeline


def per_call_ns(calls: int) -> dict[str, float]:
    def empty() -> None:
        for _ in range(calls):
            pass

    def flag() -> None:
        for _ in range(calls):
            if timeline.ENABLED:
                timeline.complete("x", 0, 0)

    def span() -> None:
        for _ in range(calls):
            with timeline.span("x"):
                pass

    def step() -> None:
        for _ in range(calls):
            steps.step_done(0.0)

    def best(fn) -> float:
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return min(runs) / calls * 1e9

    results = {"empty loop": best(empty), "timeline off: ENABLED test": best(flag),
               "timeline off: span()": best(span), "steps.step_done()": best(step)}
    steps.reset()
    with tempfile.TemporaryDirectory() as folder:
        timeline.start(os.path.join(folder, "t.json"), capacity=10_000)
        results["timeline on: span()"] = best(span)
        timeline.stop()
    return results


def _trainer(distributed: bool):
    """A closure doing one training step of a small MLP, with a torch or tandem optimizer."""
    import tandem as td

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = td.DistributedOptimizer(inner, named_parameters=model.named_parameters()) \
        if distributed else inner
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    loss_fn = nn.CrossEntropyLoss()

    def one_step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    return one_step


def per_step(n_steps: int, rounds: int = 5) -> dict[str, float]:
    """Median step time of each variant; variants take turns so machine load hits all alike."""
    import tandem as td

    td.init()
    torch.set_num_threads(1)
    variants = {"torch optimizer (reference)": (_trainer(False), False),
                "td.DistributedOptimizer": (_trainer(True), False),
                "td.DistributedOptimizer + timeline": (_trainer(True), True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(rounds):
            for name, (one_step, traced) in variants.items():
                if traced:
                    timeline.start(os.path.join(folder, "t.json"))
                for i in range(5 + n_steps // rounds):
                    seconds = one_step()
                    if i >= 5 or round_ > 0:
                        times[name].append(seconds)
                if traced:
                    timeline.stop()
    steps.reset()
    td.shutdown()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="results/instrumentation.json")
    args = parser.parse_args()

    calls = per_call_ns(args.calls)
    print(f"per call, best of 3 x {args.calls:,} calls")
    for name, ns in calls.items():
        print(f"  {name:<30} {ns:8.1f} ns")
    step = per_step(args.steps)
    reference = step["torch optimizer (reference)"]
    print(f"\nper training step, one process, MLP 256-512-512-10, batch 128, median of {args.steps}")
    for name, seconds in step.items():
        print(f"  {name:<36} {seconds * 1e3:7.3f} ms   x{seconds / reference:.3f}")
    out = write_json({"per_call_ns": calls, "per_step_s": step,
                      "ratios": {k: v / reference for k, v in step.items()}}, args.out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
