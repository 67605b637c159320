"""Peak host memory per rank while building a fully sharded model larger than one rank's budget.

    python benchmarks/meta_init.py                     # 8 ranks, 32 blocks of width 384 (144 MB)
    python benchmarks/meta_init.py --ranks 4 --blocks 8 --width 512

The model: `--blocks` MLP blocks (Linear(w, 4w), GELU, Linear(4w, w)), each one fully_shard
unit, the root a container; fp32. Its size M is 4x the budget a rank is given (budget = M/4).
Three ways to get the same sharded model, each in a world of its own (`td.spawn`, Gloo):
- `materialize`: built under `torch.device("meta")`, `td.fully_shard` per block and the root,
  `td.fsdp.materialize(model, seed=0)`: each rank keeps its shards of the one-process init;
- `eager`: `torch.manual_seed(0)`, built on the CPU, then `td.fully_shard` (every rank holds
  the whole model first);
- `fsdp2_meta`: torch's FSDP2 recipe, `fully_shard` on the meta model, `model.to_empty(...)`,
  each module's `reset_parameters()` (on Gloo/CPU; its error is reported if it does not run).

Peak memory is the rise of the process's resident high-water mark (Linux `VmHWM`, reset through
`/proc/self/clear_refs` just before building) over its resident size then: what building
really cost, allocator and all (a tiny model is built first, so that the code each method runs
is already resident and not counted). Reported: the largest over ranks, in MB, as a fraction of the
model and of the budget, and as a ratio to `eager`. `equal to 1 process`: the largest
difference between the gathered model and `torch.manual_seed(0); Net()` built in one process
(0 means the same values). JSON goes to `results/meta_init.json`.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import nn

import tandem as td
from tandem.bench.results import write_json


def build(config: dict) -> nn.Sequential:
    width = config["width"]
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width))
                           for _ in range(config["blocks"])))


def _status(field: str) -> int:
    """`field` of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)


def _materialize(config: dict) -> nn.Module:
    with torch.device("meta"):
        model = build(config)
    for block in model:
        td.fully_shard(block)
    td.fully_shard(model)
    return td.fsdp.materialize(model, seed=0)


def _eager(config: dict) -> nn.Module:
    torch.manual_seed(0)
    model = build(config)
    for block in model:
        td.fully_shard(block)
    return td.fully_shard(model)


def _fsdp2_meta(config: dict) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = build(config)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    return model


METHODS = {"materialize": _materialize, "eager": _eager, "fsdp2_meta": _fsdp2_meta}


def _full(model: nn.Module, method: str) -> dict[str, torch.Tensor]:
    if method == "fsdp2_meta":
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in model.state_dict().items()}
    return td.fsdp.full_state_dict(model)


def worker(method: str, config: dict) -> dict:
    torch.set_num_threads(1)
    try:  # a tiny model first: the code each method runs is paged in before the measurement
        METHODS[method]({**config, "blocks": 2, "width": 8})
    except Exception:
        pass  # reported by the measured call below
    gc.collect()
    before = _status("VmRSS")
    files = _status("RssFile") + _status("RssShmem")
    _reset_peak()
    start = time.perf_counter()
    try:
        model = METHODS[method](config)
    except Exception as error:  # FSDP2 on CPU/Gloo may refuse: reported, not hidden
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before
    files = _status("RssFile") + _status("RssShmem") - files
    kept = sum(t.untyped_storage().nbytes() for t in (getattr(p, "_local_tensor", p)
                                                    for p in model.parameters()))
    out = {"peak": peak, "kept": kept, "seconds": seconds, "files": files,
           "anon_end": _status("RssAnon")}
    if config["check"]:  # after the measurement: the gathered model against one process's
        full = _full(model, method)
        del model
        torch.manual_seed(0)
        reference = build(config).state_dict()
        out["difference"] = max((full[k] - v).abs().max().item() for k, v in reference.items())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the comparison with the one-process model")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="results/meta_init.json")
    args = parser.parse_args()
    config = {"blocks": args.blocks, "width": args.width, "check": args.check}
    size = sum(p.numel() * 4 for p in build({**config, "blocks": 1}).parameters()) * args.blocks
    budget = size / 4
    mb = 2**20
    print(f"{args.blocks} blocks of Linear({args.width}, {4 * args.width}) + Linear("
          f"{4 * args.width}, {args.width}), fp32: model {size / mb:.1f} MB; {args.ranks} ranks; "
          f"budget per rank = model / 4 = {budget / mb:.1f} MB")
    print(f"{'method':<12} {'peak MB/rank':>12} {'peak/model':>10} {'peak/budget':>11} "
          f"{'vs eager':>8} {'kept MB':>8} {'build s':>8} {'equal to 1 process':>19}")
    results = {"config": {**config, "ranks": args.ranks}, "torch": torch.__version__,
               "model_mb": size / mb, "budget_mb": budget / mb, "methods": {}}
    for method in args.methods.split(","):
        everyone = td.spawn(worker, nprocs=args.ranks, args=(method, config), backend="gloo")
        errors = [r["error"] for r in everyone if "error" in r]
        if errors:
            results["methods"][method] = {"error": errors[0]}
            continue
        row = {"peak_mb": max(r["peak"] for r in everyone) / mb,
               "kept_mb": max(r["kept"] for r in everyone) / mb,
               "build_s": max(r["seconds"] for r in everyone),
               "per_rank": everyone}
        if args.check:
            row["difference"] = max(r["difference"] for r in everyone)
        results["methods"][method] = row
    eager = results["methods"].get("eager", {}).get("peak_mb")
    for method, row in results["methods"].items():
        if "error" in row:
            print(f"{method:<12} did not run: {row['error']}")
            continue
        row["peak_over_model"] = row["peak_mb"] * mb / size
        row["peak_over_budget"] = row["peak_mb"] * mb / budget
        row["peak_over_eager"] = row["peak_mb"] / eager if eager else None
        equal = f"{row['difference']:.2g}" if "difference" in row else "-"
        print(f"{method:<12} {row['peak_mb']:>12.1f} {row['peak_over_model']:>10.2f} "
              f"{row['peak_over_budget']:>11.2f} "
              f"{row['peak_over_eager'] if eager else float('nan'):>8.2f} {row['kept_mb']:>8.1f} "
              f"{row['build_s']:>8.2f} {equal:>19}")
    write_json(results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
