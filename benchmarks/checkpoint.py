"""How long a checkpoint save blocks the training loop: `td.Checkpointer` sync vs `async_save=True`.

    python benchmarks/checkpoint.py                      # 100 MB and 1 GB of state, 2 ranks, Gloo
    python benchmarks/checkpoint.py --sizes-mb 100 --saves 3

One world of `--ranks` ranks (`td.spawn`, Gloo). For each total state size, a model of
Linear(1024, 1024) layers (fp32, ~4 MB each) is split over the ranks with `td.fully_shard`
(each rank writes its half), and SGD with momentum doubles the state (parameters +
momentum = the size asked for). Each of `--saves` rounds takes one optimizer step and then
saves, and we time what `save()` costs the loop:

- `sync`: `Checkpointer(...).save()` returns once every file and the metadata are on disk;
- `async`: `Checkpointer(..., async_save=True).save()` returns once the state is copied to
  host memory; the files are written by a thread while training goes on (here: the loop
  keeps stepping until the thread is done, as a job that saves every N steps does), and the
  save is published at the start of the next one (`wait()`: a gather of the ranks' results,
  the metadata, a rename), which is counted as blocking too.

The table prints the median blocking time per save and the ratio async / sync (target
<= 1/3). JSON goes to `results/checkpoint.json`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import tandem as td
from tandem.bench.results import write_json

LAYER_MB = 4 * 1024 * 1024 * 4 / 2**20  # a Linear(1024, 1024) weight in fp32: 4 MiB


def measure(sizes_mb: list[int], saves: int, root: str) -> list[dict]:
    rows = []
    for size in sizes_mb:
        layers = max(1, round(size / 2 / LAYER_MB))  # parameters + momentum = size
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
        for layer in model:
            td.fully_shard(layer)
        td.fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(8, 1024)
        result = {"state_mb": size, "layers": layers}
        for mode in ("sync", "async"):
            directory = os.path.join(root, f"{size}-{mode}")
            checkpointer = td.Checkpointer(directory, keep=1, async_save=mode == "async")
            blocked = []
            for step in range(saves):
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
                pending = checkpointer._pending
                while pending is not None and not td.allreduce(torch.tensor(
                        float(pending.done())), op="min").item():
                    model(x).square().mean().backward()  # training goes on while the thread writes
                td.barrier()
                start = time.perf_counter()
                checkpointer.save(step, model=model, optimizer=optimizer)  # finishes the last one
                blocked.append(time.perf_counter() - start)
            checkpointer.wait()
            result[f"{mode}_s"] = statistics.median(blocked)
            td.barrier()
            if td.rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)
        result["async_over_sync"] = result["async_s"] / result["sync_s"]
        rows.append(result)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tandem-ckpt-bench-")
    rows = td.spawn(measure, args.ranks, args=(args.sizes_mb, args.saves, root), backend="gloo")[0]
    print(f"{'state':>8} {'sync save':>11} {'async save':>11} {'async/sync':>11}   ({args.ranks} ranks, "
          f"Gloo, fully_shard + SGD momentum, median of {args.saves})")
    for row in rows:
        print(f"{row['state_mb']:>6} MB {row['sync_s'] * 1e3:>8.0f} ms {row['async_s'] * 1e3:>8.0f} ms "
              f"{row['async_over_sync']:>11.2f}")
    out = write_json({"ranks": args.ranks, "saves": args.saves, "rows": rows}, "results/checkpoint.json")
    print(f"JSON: {out}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
