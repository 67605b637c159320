"""Tensor parallelism on 2 ranks: a transformer block's training step at tp = 1 and 2, beside
PyTorch's own DTensor `parallelize_module` on the same block.

    python benchmarks/tensor_parallel.py [--dim 512] [--heads 8] [--tokens 2048] [--rounds 7]
                                         [--out results/tensor_parallel.json]

The block (tandem.bench.models.Block: pre-LayerNorm attention + MLP 4×dim) runs forward,
backward and an SGD step on a batch of `--tokens` tokens (sequences of 64). Every process runs
one thread.

- tp=1: each rank runs the whole block alone (the one-process step); tp=2: `td.parallelize`
  splits the heads and the MLP over the 2 ranks; torch: `parallelize_module` with
  ColwiseParallel/RowwiseParallel on the same layers, over a 1-D DeviceMesh on Gloo.
- Step time: the slower rank's wall time after a barrier, median over interleaved rounds.
- Parameter memory: bytes of the parameters each rank holds.
- Communicated: payload bytes tandem's regions hand to its collectives in one step (counted by
  wrapping the two calls), against the theory: 2 all-reduces forward (attention output, MLP
  output) and 2 backward (the inputs of q/k/v and of the MLP), each tokens × dim × 4 bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import tandem as td
from tandem.bench.models import Block
from tandem.bench.results import write_json
from tandem.parallel.tensor import regions

PLAN = {"attn": "heads", "mlp.0": "colwise", "mlp.2": "rowwise"}
SEQUENCE = 64


def _counting(counter: dict):
    """Wrap the regions' two collectives so that a step's payload bytes are counted."""
    reduce, gather = regions._allreduce, regions._gather_last

    def counted_reduce(tensor, group):
        if regions.group_size(group) > 1:
            counter["bytes"] += tensor.numel() * tensor.element_size()
        return reduce(tensor, group)

    def counted_gather(tensor, group):
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return gather(tensor, group)

    regions._allreduce, regions._gather_last = counted_reduce, counted_gather


def _torch_tp(block: Block):
    """The same block under DTensor's parallelize_module, or the error that prevents it."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (td.size(),))
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.out": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        model = parallelize_module(block, mesh, plan)
        model.attn.num_heads //= td.size()  # local heads, as PyTorch's tutorial does
        return model, None
    except Exception as error:  # noqa: BLE001 - reported in the table, not hidden
        return None, f"{type(error).__name__}: {error}"


def ranks_main(args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.tokens // SEQUENCE, SEQUENCE, args.dim)
    torch.manual_seed(0)
    models = {"tp=1": Block(args.dim, args.heads, 4 * args.dim)}
    torch.manual_seed(0)
    models["tp=2"] = td.parallelize(Block(args.dim, args.heads, 4 * args.dim), PLAN)
    torch.manual_seed(0)
    torch_model, torch_error = _torch_tp(Block(args.dim, args.heads, 4 * args.dim))
    if torch_model is not None:
        models["torch tp=2"] = torch_model
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    counter = {"bytes": 0}
    _counting(counter)
    times, sent, errors = {}, {}, {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, model in models.items():
            td.barrier()
            counter["bytes"] = 0
            start = time.perf_counter()
            try:
                optimizers[name].zero_grad()
                model(x).square().mean().backward()
                optimizers[name].step()
            except Exception as error:  # noqa: BLE001
                errors[name] = f"{type(error).__name__}: {error}"
                continue
            if round_:
                times.setdefault(name, []).append(time.perf_counter() - start)
            sent[name] = counter["bytes"]
    memory = {name: sum(_local(p).numel() * p.element_size() for p in m.parameters())
              for name, m in models.items()}
    # The same step's result: each model's output on a fresh input against tp=1's (all took the
    # same steps from the same start).
    with torch.no_grad():
        probe = torch.randn(2, SEQUENCE, args.dim, generator=torch.Generator().manual_seed(5))
        reference = models["tp=1"](probe)
        differs = {name: float((_local(m(probe)) - reference).abs().max()) for name, m in models.items()}
    return {"times": times, "sent": sent, "memory": memory, "errors": errors, "torch_error": torch_error,
            "max_diff": differs}


def _local(tensor):
    """A DTensor's local shard (what the rank holds), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def summarize(results, args):
    tokens_bytes = args.tokens * args.dim * 4
    theory = {"tp=1": 0, "tp=2": 4 * tokens_bytes, "torch tp=2": 4 * tokens_bytes}
    rows = []
    base = None
    for name in ("tp=1", "tp=2", "torch tp=2"):
        if name not in results[0]["times"]:
            continue
        rounds = zip(*(r["times"][name] for r in results), strict=True)
        step = statistics.median(max(t) for t in rounds)
        base = base or step
        rows.append({"config": name, "step_ms": step * 1e3, "vs_tp1": step / base,
                     "param_MiB": results[0]["memory"][name] / 2**20,
                     "sent_MiB": results[0]["sent"].get(name, 0) / 2**20 if name != "torch tp=2" else None,
                     "theory_MiB": theory[name] / 2**20,
                     "max_diff_vs_tp1": max(r["max_diff"][name] for r in results)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="results/tensor_parallel.json")
    args = parser.parse_args(argv)
    results = td.spawn(ranks_main, 2, args=(args,))
    rows = summarize(results, args)
    print("| config | step ms | / tp=1 | params MiB per rank | sent MiB per step (theory) "
          "| max |out - tp=1| |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        sent = "n/a" if row["sent_MiB"] is None else f"{row['sent_MiB']:.1f}"
        print(f"| {row['config']} | {row['step_ms']:.0f} | {row['vs_tp1']:.2f} | {row['param_MiB']:.1f} | "
              f"{sent} ({row['theory_MiB']:.1f}) | {row['max_diff_vs_tp1']:.1e} |")
    torch_error = results[0]["torch_error"] or results[0]["errors"].get("torch tp=2")
    if torch_error:
        print(f"PyTorch DTensor tensor parallelism did not run: {torch_error}")
    print(f"wrote {write_json({'args': vars(args), 'rows': rows, 'torch_error': torch_error}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
