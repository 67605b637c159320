"""Lightning's Trainer on strategy="tandem" against Lightning's own "ddp", in the same job.

    tandem run -np 2 benchmarks/lightning_vs_ddp.py                  # MPI (the CPU default)
    tandem run -np 2 --backend gloo benchmarks/lightning_vs_ddp.py   # Gloo
    tandem run -np 2 benchmarks/lightning_vs_ddp.py --steps 30 --reps 5 --out results/lightning_vs_ddp.json

Every rank runs both strategies, one `Trainer.fit` after the other, alternating over `--reps`
repetitions in an order that rotates (so that slow phases of a shared machine hit both alike).
Same model (the MLP 784-2048-2048-10 of `tandem.bench.models`), same synthetic data, same
per-rank batch (64), SGD with momentum, one thread per rank. A step is timed from Lightning's
`on_train_batch_start` to `on_train_batch_end` (forward, backward with its gradient reduction,
optimizer step), after `--warmup` untimed steps; a repetition is summarised by each strategy's
median step. Reported: the median over repetitions of each strategy's step time and samples/s
(global batch / step), and of the paired ratio ddp step / tandem step (> 1: tandem is faster).

td.init() runs first, so Lightning's DDPStrategy finds torch.distributed initialised and runs
torch's DDP over the job's default group: Gloo's under `--backend gloo`, and under MPI the
group tandem registers (backend "tandem" over the MPI engine). "tandem" is
td.DistributedDataParallel over the same engine. The table is printed on rank 0 and written to
JSON (`results/lightning_vs_ddp.json` by default).
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import tandem as td
from tandem.bench.models import mlp
from tandem.bench.results import write_json

BATCH = 64  # per rank


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp(784, 2048, 2048, 10)

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(L.Callback):
    """Wall time of each training step (forward, backward and reduction, optimizer step)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


def run(strategy: str, steps: int, warmup: int) -> float:
    """Median step time (s) of one fit with this strategy."""
    g = torch.Generator().manual_seed(td.rank())
    n = BATCH * (steps + warmup)
    data = TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))
    timer = StepTimer(warmup)
    chosen = "tandem" if strategy == "tandem" else DDPStrategy()
    trainer = L.Trainer(strategy=chosen, accelerator="cpu", devices=td.local_size(),
                        max_steps=steps + warmup, callbacks=[timer], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Net(), DataLoader(data, batch_size=BATCH))  # each rank its own data already
    return statistics.median(timer.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="results/lightning_vs_ddp.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # no banners in the table
    warnings.filterwarnings("ignore")
    world = td.init()  # first: Lightning's DDP then runs over the job's own default group
    methods = ["tandem", "ddp"]
    per_rep: list[dict[str, float]] = []
    for rep in range(args.reps):
        order = methods[rep % 2:] + methods[:rep % 2]
        per_rep.append({m: run(m, args.steps, args.warmup) for m in order})
    summary = {}
    for m in methods:
        step = statistics.median(r[m] for r in per_rep)
        summary[m] = {"step_ms": step * 1e3, "samples_per_s": BATCH * world.size / step}
    ratio = statistics.median(r["ddp"] / r["tandem"] for r in per_rep)
    if world.rank == 0:
        print(f"Lightning Trainer, MLP 784-2048-2048-10, {world.size} ranks on {world.backend}, "
              f"batch {BATCH} per rank, median of {args.reps} reps x {args.steps} steps")
        print("| strategy | step (ms) | samples/s |\n|---|---|---|")
        for m, label in (("tandem", 'strategy="tandem"'), ("ddp", 'strategy="ddp" (torch DDP)')):
            print(f"| {label} | {summary[m]['step_ms']:.1f} | {summary[m]['samples_per_s']:.0f} |")
        print(f"ddp step / tandem step (paired per repetition): {ratio:.2f}")
        out = write_json({"backend": world.backend, "ranks": world.size, "batch_per_rank": BATCH,
                          "steps": args.steps, "reps": args.reps, "per_rep_s": per_rep,
                          "summary": summary, "ratio_ddp_over_tandem": ratio,
                          "machine": platform.node(), "torch": torch.__version__,
                          "lightning": L.__version__}, args.out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
